"""`meshnet chat`: a conversation with the split model in a terminal.

Each turn's prompt is the whole conversation put through the model's own chat template
(the GGUF's, applied by llama.cpp in the workers: none of it is written here), then
tokenized with its special tokens parsed, as llama-server does. The answer streams as
its bytes arrive. Ctrl-C cancels the answer's session and keeps what was shown of it;
at the prompt it only gives a fresh line; Ctrl-D ends the chat.
"""

from __future__ import annotations

import codecs
import sys
from typing import Callable

from meshnet.core import errors
from meshnet.core.conversation import answer_sampling, fit, prompt_tokens
from meshnet.core.errors import MeshnetError
from meshnet.core.sampling import Sampling
from meshnet.launch.supervisor import SUPERVISED_RESUME_WAIT

SETTLE_S = 10.0          # how long a cancelled session may take to say it has ended
# how long a chat waits for its route to be whole again before it ends: a local worker
# that died is started again (launch/supervisor.py), in a second or two
ROUTE_BACK_S = SUPERVISED_RESUME_WAIT


class Chat:
    def __init__(self, coordinator, *, n_ctx: int, max_tokens: int, sampling: Sampling | None = None,
                 seed_given: bool = False, system: str | None = None, out=None, err=None):
        self.coordinator = coordinator
        self.n_ctx, self.max_tokens = n_ctx, max_tokens
        self.sampling, self.seed_given = sampling, seed_given
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.out, self.err = out, err
        self.last_metrics: dict = {}      # of the last answer that ran to its end (tests, the curious)
        self.last_prompt_tokens: list[int] = []

    # output: stdout for the conversation, stderr for what is said about it

    def _say(self, text: str) -> None:
        out = self.out or sys.stdout
        out.write(text)
        out.flush()

    def _note(self, text: str) -> None:
        (self.out or sys.stdout).flush()
        err = self.err or sys.stderr
        err.write(text + "\n")
        err.flush()

    # the loop

    def run(self, read_line: Callable[[str], str] = input) -> None:
        """Turns until end of input. A turn's error is reported and the chat goes on; one
        that leaves no route over the model is raised (nothing more can be answered)."""
        while True:
            try:
                line = read_line("> ")
            except KeyboardInterrupt:
                self._say("\n")   # as a shell does: the line is dropped, a fresh prompt
                continue
            except EOFError:
                self._say("\n")
                return
            if not line.strip():
                continue
            try:
                self.ask(line)
            except KeyboardInterrupt:   # before any answer began (a second Ctrl-C while stopping, say)
                self._say("\n")
                self._note("[stopped]")
            except MeshnetError as e:
                if self._route_gone():
                    raise
                self._note(f"error: {e}")

    def _route_gone(self) -> bool:
        try:
            self.coordinator.wait_for_route(ROUTE_BACK_S)
            return False
        except MeshnetError:
            return True

    def ask(self, text: str) -> str:
        """One turn: the answer to text, given the conversation so far, streamed to the
        output and added to the conversation (what was shown of it, if stopped)."""
        self.messages.append({"role": "user", "content": text})
        try:
            fitted = fit(self.messages, lambda ms: prompt_tokens(self.coordinator, ms), self.n_ctx, self.max_tokens)
        except BaseException:
            self.messages.pop()
            raise
        if fitted.dropped_turns:
            self._note(f"[the {fitted.dropped_turns} oldest turn{'s' if fitted.dropped_turns > 1 else ''} left the "
                       f"conversation: it no longer fit the context of {self.n_ctx} tokens]")
            self.messages = fitted.messages
        self.last_prompt_tokens = fitted.tokens
        shown = []
        try:
            self._stream(fitted.tokens, shown)
        except KeyboardInterrupt:
            self._say("\n")
            self._note("[stopped]")
        except MeshnetError:
            if shown:
                self._say("\n")
            self._keep(shown)
            raise
        return self._keep(shown)

    def _keep(self, shown: list[str]) -> str:
        answer = "".join(shown)
        if answer:
            self.messages.append({"role": "assistant", "content": answer})
        else:   # nothing was answered: the question goes too, so that turns stay in pairs
            self.messages.pop()
        return answer

    def _stream(self, tokens: list[int], shown: list[str]) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        handle = None
        try:
            handle = self.coordinator.generate(tokens, self.max_tokens,
                                               sampling=answer_sampling(self.sampling, self.seed_given))
            for event in handle:
                text = decoder.decode(event.piece)
                self._say(text)
                shown.append(text)
        except KeyboardInterrupt:
            if handle is not None:
                handle.cancel()
                self._settle(handle)
            raise
        shown.append(decoder.decode(b"", final=True))
        self._say(shown[-1] + "\n")
        self.last_metrics = dict(handle.metrics, stop_reason=handle.stop_reason)
        if handle.stop_reason == "length":   # why the answer ends mid-sentence
            self._note(f"[--max-tokens {self.max_tokens} reached]")

    def _settle(self, handle) -> None:
        """Wait for the cancelled session's end, so that the next turn finds its slot free."""
        try:
            handle.result(timeout=SETTLE_S)
        except MeshnetError as e:
            if e.code != errors.CANCELLED:
                self._note(f"error: {e}")
