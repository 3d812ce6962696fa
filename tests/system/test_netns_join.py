"""Join a machine in one command, shown in two network namespaces on this machine
(tools/netns-join.sh): host B, with meshnet and no model file, joins host A's mesh with a
join token that names no address (it finds A by mDNS), fetches only its share of the
model's bytes over CURVE, and the route across the two gives the whole model's tokens and
logits exactly."""

from pathlib import Path

from meshnet.engine.gguf_layout import read_layout

from test_netns import run_script

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "netns-join.sh"


def test_a_host_without_the_model_joins_by_token_and_discovery_and_fetches_only_its_share(smollm2_path):
    report = run_script(SCRIPT)
    n_layer = read_layout(smollm2_path).n_layer
    half = n_layer // 2
    assert report["ok"], report
    # the route spans both hosts: A's worker the first half (as planned within its --mem), B the rest
    assert report["route"] == [f"[0,{half})", f"[{half},{n_layer})"], report
    assert report["route_hosts"] == ["10.77.0.1", "10.77.0.2"], report
    assert report["b_range"] == f"[{half},{n_layer})"
    assert report["parity"] is True and report["max_logit_diff"] == 0.0, report
    # every link CURVE, as ZeroMQ reports it: the coordinator's, each stage's, the holder's
    assert report["curve"] is True, report
    assert report["holder_mechanism"] == "CURVE"
    assert report["mechanisms"]["coordinator"] == {"control": "CURVE", "data": "CURVE"}
    assert all(m["control"] == "CURVE" and m["data"] == "CURVE" and set(m["pushes_opened"]) == {"CURVE"}
               for m in report["mechanisms"]["stages"].values()), report["mechanisms"]
    # B found A by mDNS: its token named no address
    assert report["discovery"] is True and report["token_addresses"] == []
    assert report["status_discover"] is True   # `meshnet status --discover` in B lists A
    # B's sparse file: the model's length, about its share on disk
    assert report["b_file_length"] == report["file_bytes"]
    assert report["b_share_bytes"] < report["file_bytes"]
    assert report["disk_ratio"] <= 1.05, report
    assert report["fetch_bytes"] == report["b_share_bytes"]   # the header and its range's tensors, once
    # the speeds are reported, not held to a ratio here: that is for benchmarks
    assert report["fetch_MBps"] > 0 and report["cat_MBps"] > 0, report
    print(f"\nB fetched {report['fetch_bytes']} bytes at {report['fetch_MBps']:.1f} MB/s; a plain TCP copy of as "
          f"many ran at {report['cat_MBps']:.1f} MB/s: fetch/cat {report['fetch_to_cat']:.3f} (target 0.8); "
          f"disk {report['b_disk_bytes']} for a share of {report['b_share_bytes']}: {report['disk_ratio']:.4f}")
