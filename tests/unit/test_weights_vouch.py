"""The coordinator's answer to HOLDERS, with plain data (the voucher's threads are not
started here): however many holders register and however many are refused, and however long
their endpoints and the reasons, the answer fits the protocol's header limit, so that
every joining worker can still read it."""

import threading

from meshnet.net import protocol as P
from meshnet.weights.fetch import HolderAddress
from meshnet.weights.vouch import NotTheModel, Voucher

SHA = "ab" * 32
KEY = "k" * 40


def endpoint(i: int) -> str:
    return f"tcp://holder-{i:05d}.{'x' * 220}.lan:{1000 + i}"   # near the 256 characters a field takes


def test_the_answer_to_holders_fits_the_header_limit_however_many_holders_register_and_are_refused(monkeypatch):
    # what the voucher answers is decided by what it was told: its threads (probing, hashing) are not started
    monkeypatch.setattr(threading.Thread, "start", lambda thread: None)
    voucher = Voucher(None)
    registered = [(endpoint(i), KEY, SHA) for i in range(2000)]
    voucher.answer(b"w", registered)
    for i in range(0, 2000, 2):
        voucher._refuse(HolderAddress(endpoint(i), KEY.encode()), NotTheModel("its bytes are not the model's " * 80))
    info, payload = voucher.answer(b"w", registered)
    header = P.encode(P.OK, 1, payload, info=info)[0]
    assert len(header) <= P.MAX_HEADER_BYTES, len(header)
    assert P.decode([header], 0).type == P.OK
    assert info["holders"] and all(h[0] in {e for e, _, _ in registered} for h in info["holders"])
    assert not {h[0] for h in info["holders"]} & {endpoint(i) for i in range(0, 2000, 2)}   # the refused are not listed
    assert 0 < len(info["why"]) <= 1024 and endpoint(1998) in info["why"]   # the latest refusals, cut short
