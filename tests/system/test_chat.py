"""meshnet chat and meshnet run --chat: the model's own chat template, a conversation
with its history, streamed answers, Ctrl-C and Ctrl-D in a real terminal."""

import io
import os
import re
import signal
import sys
import time

import pexpect
import pytest

from meshnet.cli.chat import Chat
from meshnet.core import errors
from meshnet.core.conversation import answer_sampling, fit
from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import Sampling
from meshnet.engine.gguf_layout import read_layout
from meshnet.engine.pipeline import LocalPipeline
from meshnet.launch.local_cluster import LocalCluster, children_of

from conftest import THREADS, last_json_line, meshnet
from peers import alive

PROMPT = "\r\n> "   # the chat's prompt at the start of a line, as the terminal shows it


# the history's trimming, on plain data: a token is a word

def words(messages):
    return " ".join(m["content"] for m in messages).split()


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "be brief"}


def test_a_conversation_that_fits_is_kept_whole():
    messages = [SYSTEM, user("a b"), assistant("c d"), user("e")]
    fitted = fit(messages, words, n_ctx=10, max_tokens=3)
    assert fitted.messages == messages and fitted.tokens == words(messages) and fitted.dropped_turns == 0


def test_the_oldest_turns_go_first_and_the_system_message_stays():
    messages = [SYSTEM, user("q1 q1 q1"), assistant("a1 a1 a1"), user("q2"), assistant("a2"), user("q3 q3")]
    # 12 words + 4 new tokens > 14: the first turn (q1 and its answer) must go, then it fits
    fitted = fit(messages, words, n_ctx=14, max_tokens=4)
    assert fitted.messages == [SYSTEM, user("q2"), assistant("a2"), user("q3 q3")]
    assert fitted.dropped_turns == 1 and len(fitted.tokens) == 6
    # tighter: only the system message and the question being asked are left
    fitted = fit(messages, words, n_ctx=8, max_tokens=4)
    assert fitted.messages == [SYSTEM, user("q3 q3")] and fitted.dropped_turns == 2
    assert messages[1] == user("q1 q1 q1")   # the caller's list is not touched


def test_a_reply_without_its_question_goes_with_the_oldest_turn():
    messages = [assistant("hello there"), user("q1"), assistant("a1"), user("q2")]
    fitted = fit(messages, words, n_ctx=4, max_tokens=2)
    assert fitted.messages == [user("q2")] and fitted.dropped_turns == 2


def test_a_question_that_does_not_fit_alone_says_so_with_the_numbers():
    messages = [SYSTEM, user("q1"), assistant("a1"), user("x " * 20)]
    with pytest.raises(MeshnetError) as e:
        fit(messages, words, n_ctx=16, max_tokens=4)
    assert e.value.code == errors.CONTEXT_FULL
    assert e.value.context == {"prompt_tokens": 22, "max_tokens": 4, "n_ctx": 16}
    assert "22 tokens" in e.value.message and "system message" in e.value.message


def test_each_answer_draws_a_fresh_seed_unless_one_is_given():
    assert answer_sampling(None, False) is None
    warm = Sampling(temperature=0.8)
    assert len({answer_sampling(warm, False).seed for _ in range(4)}) == 4
    assert answer_sampling(Sampling(temperature=0.8, seed=7), True).seed == 7
    assert answer_sampling(Sampling(top_k=5), False) == Sampling(top_k=5)   # greedy needs no seed


# a conversation with the real model on real workers

@pytest.fixture(scope="module")
def coordinator(smollm2_path):
    ranges = read_layout(smollm2_path).balanced_ranges(2)
    with LocalCluster(smollm2_path, ranges, threads=THREADS, n_ctx=1024, max_sessions=1) as cluster:
        yield cluster.coordinator


def quiet_chat(coordinator, **options):
    return Chat(coordinator, **{"n_ctx": 1024, "max_tokens": 16, "out": io.StringIO(), "err": io.StringIO(),
                                **options})


def test_each_turn_is_prompted_with_the_whole_conversation_through_the_template(coordinator):
    chat = quiet_chat(coordinator)
    first = chat.ask("My cat is called Tom. Say OK.")
    second = chat.ask("What is my cat called?")
    assert first and second
    assert chat.messages == [user("My cat is called Tom. Say OK."), assistant(first),
                             user("What is my cat called?"), assistant(second)]
    assert chat.out.getvalue() == first + "\n" + second + "\n"   # streamed as it came, a line per answer
    # the second answer was generated from the template over both turns, special tokens parsed
    text = coordinator.chat_prompt(chat.messages[:3])
    assert text.index("My cat is called Tom") < text.index(first) < text.index("What is my cat called?")
    assert chat.last_prompt_tokens == coordinator.tokenize(text, add_special=True, parse_special=True)
    assert chat.last_metrics["prompt_tokens"] == len(chat.last_prompt_tokens)
    assert len(chat.last_prompt_tokens) < len(coordinator.tokenize(text))   # <|im_start|> is one token, not seven


class InterruptedOutput(io.StringIO):
    """A terminal where Ctrl-C comes while the answer's nth piece is being shown."""

    def __init__(self, at_piece):
        super().__init__()
        self.pieces_left = at_piece

    def write(self, text):
        self.pieces_left -= 1
        if self.pieces_left == 0:
            raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_mid_answer_cancels_the_session_keeps_what_was_shown_and_the_chat_goes_on(coordinator):
    chat = quiet_chat(coordinator, max_tokens=200, out=InterruptedOutput(at_piece=4))
    cancelled = coordinator.metrics()["sessions"].get("cancelled", 0)
    partial = chat.ask("Tell me a long story about a dragon.")
    assert "[stopped]" in chat.err.getvalue()
    assert coordinator.metrics()["sessions"]["cancelled"] == cancelled + 1
    assert partial and chat.out.getvalue() == partial + "\n"
    assert chat.messages[-1] == assistant(partial)
    # the cancelled session's slot (max_sessions 1) is free again: the next turn is answered
    assert chat.ask("Thank you.") and chat.messages[-1]["role"] == "assistant" and len(chat.messages) == 4


def test_a_full_context_drops_the_oldest_turns_and_a_question_too_long_alone_is_refused(coordinator):
    chat = quiet_chat(coordinator, n_ctx=100, max_tokens=8, system="You answer in one word.")
    for question in ("Name a fruit that is yellow and long and grows in hot countries.",
                     "Name an animal that lives in the sea and is very large and blue.",
                     "Name a city that is the capital of Italy and is very old and famous.",
                     "Name a colour of the sky on a clear summer day in the afternoon."):
        chat.ask(question)
        assert len(chat.last_prompt_tokens) + 8 <= 100
    assert "oldest turn" in chat.err.getvalue() and "context of 100 tokens" in chat.err.getvalue()
    assert chat.messages[0] == {"role": "system", "content": "You answer in one word."}
    assert chat.messages[-2] == user("Name a colour of the sky on a clear summer day in the afternoon.")
    assert user("Name a fruit that is yellow and long and grows in hot countries.") not in chat.messages

    before = list(chat.messages)
    with pytest.raises(MeshnetError) as e:
        chat.ask("word " * 200)
    assert e.value.code == errors.CONTEXT_FULL and "100" in e.value.message
    assert chat.messages == before


# meshnet chat in a real terminal

def _answer(child, question, timeout=60):
    """Send a question; [(arrival time, text)] of what the terminal showed until the next prompt."""
    child.sendline(question)
    child.expect_exact(question + "\r\n")   # the terminal's echo of the typed line
    chunks = [(time.monotonic(), child.buffer)] if child.buffer else []
    child.buffer = ""
    while not "".join(text for _, text in chunks).endswith(PROMPT):
        chunks.append((time.monotonic(), child.read_nonblocking(4096, timeout=timeout)))
    return chunks


def test_meshnet_chat_in_a_terminal_streams_survives_ctrl_c_and_quits_on_ctrl_d(smollm2_path):
    # a budget no answer here spends before the test acts: the first answer ends of itself (at
    # its end-of-generation token), and the interrupted one, a story that goes on, would take
    # most of a minute to spend it (2000 tokens at 35-45 a second on 2 cores), so it is still
    # being generated when Ctrl-C comes from a test held up for many seconds
    child = pexpect.spawn(sys.executable, ["-m", "meshnet.cli.main", "chat", "--threads", "1", "--max-tokens", "2000",
                                           "--ctx", "4096"], encoding="utf-8", timeout=60, dimensions=(24, 200))
    workers = []
    try:
        child.expect_exact("Ctrl-C stops an answer, Ctrl-D quits.")
        child.expect_exact("> ")
        workers = children_of(child.pid)
        assert len(workers) == 2

        # an answer, streamed: its first words are on the screen long before its last
        chunks = _answer(child, "Describe a dragon in three sentences.")
        answer = "".join(text for _, text in chunks)[: -len(PROMPT)]
        assert len(answer.split()) > 30, answer
        first_words = next(t for t, text in chunks if text.strip())
        assert chunks[-1][0] - first_words > 1.0 and len(chunks) > 5, [(round(t, 2), text) for t, text in chunks]

        # Ctrl-C while the next answer streams stops it, not the chat (nor its workers)
        question = "Tell me another long story, about a knight and a castle."
        child.sendline(question)
        child.expect_exact(question + "\r\n")
        child.expect(r"\w")   # the answer's first letters: it is being generated
        interrupted = time.monotonic()
        child.sendintr()
        # (the prompt before [stopped] would be an answer that ended of itself: not what this tests)
        assert child.expect_exact(["[stopped]", PROMPT], timeout=10) == 0, child.before
        assert time.monotonic() - interrupted < 3
        child.expect_exact(PROMPT)
        chunks = _answer(child, "What is the capital of France?")
        assert "".join(text for _, text in chunks)[: -len(PROMPT)].strip()

        # Ctrl-C at the prompt: a fresh prompt line, as in a shell. (Not at once: CPython's
        # readline loop leaves a signal that lands between showing the prompt and waiting for
        # a key until the next key; no hand types that fast.)
        time.sleep(0.5)
        child.sendintr()
        child.expect_exact(PROMPT, timeout=10)
        assert child.isalive() and all(alive(pid) for pid in workers)

        # Ctrl-D: the chat ends, cleanly, and its workers with it
        child.sendeof()
        child.expect(pexpect.EOF, timeout=30)
        child.close()
        assert (child.exitstatus, child.signalstatus) == (0, None)
        assert "Traceback" not in child.before
        deadline = time.monotonic() + 60   # they go at once; a loaded machine may take its time to show it
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers)
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_meshnet_chat_starts_a_worker_that_died_again_and_answers_on(smollm2_path):
    """chat starts its workers itself, so one killed between two questions is started
    again (launch/supervisor.py) and the next question is answered, as the first was."""
    child = pexpect.spawn(sys.executable, ["-m", "meshnet.cli.main", "chat", "--threads", "1", "--max-tokens", "8",
                                           "--ctx", "256"], encoding="utf-8", timeout=60)
    try:
        child.expect_exact("Ctrl-D quits.")
        child.expect_exact("> ")
        child.sendline("Hello?")
        child.expect_exact("> ")
        head, tail = sorted(children_of(child.pid))   # started in route order
        os.kill(tail, signal.SIGKILL)
        child.expect_exact("starting it again", timeout=30)
        child.expect_exact("loaded layers [19,30)", timeout=60)   # the new tail
        child.sendline("And now?")
        child.expect_exact("> ", timeout=90)
        said = child.before.replace("\r\n", "\n")
        if "error: [route_incomplete]" in said:   # asked before the new tail had offered its range
            child.sendline("And now?")
            child.expect_exact("> ", timeout=90)
            said = child.before.replace("\r\n", "\n")
        assert "error: [" not in said and "Traceback" not in said, said
        assert said.strip(), said   # an answer
        assert tail not in children_of(child.pid) and len(children_of(child.pid)) == 2
        child.sendeof()
        child.expect(pexpect.EOF, timeout=60)
        child.close()
        assert child.exitstatus == 0
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)


# meshnet run --chat: one answer

def test_run_chat_answers_one_message_through_the_template_on_workers_and_in_process(smollm2_path):
    message = "What is the capital of France?"
    args = ["run", "--chat", message, "--json", "--max-tokens", "16", "--threads", str(THREADS)]
    on_workers, in_process = meshnet(*args), meshnet(*args, "--in-process")
    assert on_workers.returncode == 0 and in_process.returncode == 0, on_workers.stderr + in_process.stderr
    report = last_json_line(on_workers.stdout)
    assert report["tokens"] and report["text"].strip()
    assert last_json_line(in_process.stdout)["tokens"] == report["tokens"]
    # the prompt was the template's, special tokens parsed, and the answer is the whole model's to it
    with LocalPipeline(smollm2_path, [(0, 30)], n_ctx=2048, max_sessions=1, n_threads=THREADS) as whole:
        template = whole.head.chat_template([user(message)])
        assert template.startswith("<|im_start|>user\n" + message)   # SmolLM2's own (ChatML), from its GGUF
        tokens = whole.head.tokenize(template, add_special=True, parse_special=True)
        assert report["metrics"]["prompt_tokens"] == len(tokens)
        assert report["tokens"] == whole.generate(tokens, 16).tokens
        assert report["text"] == whole.tail.detokenize(report["tokens"])

    text = meshnet("run", "--chat", message, "--max-tokens", "16")   # the answer alone, streamed, then the summary
    assert text.returncode == 0 and text.stdout.strip() == report["text"].strip(), text.stderr


def test_run_samples_with_a_seed_the_same_tokens_on_workers_and_in_process(arch_models):
    args = ["run", "--model", arch_models["llama"], "--json", "--max-tokens", "12", "--threads", str(THREADS), "--temperature", "0.9", "--top-p",
            "0.95", "--seed", "7", "--prompt", "Once upon a time"]
    on_workers, in_process = meshnet(*args), meshnet(*args, "--in-process")
    assert on_workers.returncode == 0 and in_process.returncode == 0, on_workers.stderr + in_process.stderr
    a, b = last_json_line(on_workers.stdout), last_json_line(in_process.stdout)
    assert a["tokens"] and a["tokens"] == b["tokens"]
    assert a["metrics"]["sampling"] == {"temperature": 0.9, "top_p": 0.95, "seed": 7}

    bad = meshnet("run", "--model", arch_models["llama"], "--top-p", "2")
    assert bad.returncode == 2 and "--top-p" in bad.stderr and "top_p must be within" in bad.stderr
