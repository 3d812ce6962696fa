"""`n` choices of one OpenAI request: n generations, each a session of its own (each waits
for its slot as any request does), merged into one answer: the choices indexed 0..n-1, the
prompt's tokens counted once and the completions' summed, as OpenAI counts them. With a
seed, choice i is drawn with seed + i (the same request gives the same n choices); greedy
decoding gives n equal choices, as it must."""

from __future__ import annotations

import asyncio

from fastapi.responses import StreamingResponse

from meshnet.core import errors
from meshnet.serve.chat import openai_chunks
from meshnet.serve.openai import ApiError, sse

MAX_CHOICES = 8   # sessions one request may hold at once


async def answer_choices(body, one):
    """The answer to BODY with its n choices; ONE(body with n 1) answers one of them."""
    n = 1 if body.n is None else body.n
    if n == 1:
        return await one(body)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be 1 to {MAX_CHOICES} (choices of one request, each a session), not {n}",
                       code=errors.INVALID_ARGUMENT, param="n")
    bodies = [body.model_copy(update={"n": 1, "seed": None if body.seed is None else body.seed + i})
              for i in range(n)]
    results = await asyncio.gather(*(one(b) for b in bodies), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None or not all(isinstance(r, (dict, StreamingResponse)) for r in results):
        for r in results:   # the others' sessions end now
            if isinstance(r, StreamingResponse):
                await r.body_iterator.aclose()
        if failed is not None:
            raise failed
        return next(r for r in results if not isinstance(r, (dict, StreamingResponse)))   # (a client gone)
    if isinstance(results[0], dict):
        return _merged(results)
    return StreamingResponse(_merged_stream(results), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _merged(answers: list[dict]) -> dict:
    first = answers[0]
    choices = [dict(a["choices"][0], index=i) for i, a in enumerate(answers)]
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    usage = dict(first["usage"], completion_tokens=completion,
                 total_tokens=first["usage"]["prompt_tokens"] + completion)
    return dict(first, choices=choices, usage=usage)


async def _merged_stream(streams: list[StreamingResponse]):
    """The n streams' chunks as one stream as they come, each choice at its index, under the
    first chunk's id; one usage chunk (if asked) and one [DONE] at the end."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: StreamingResponse):
        try:
            async for chunk in openai_chunks(stream):
                await queue.put((i, chunk))
        finally:
            await queue.put((i, StopAsyncIteration))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    head, usages, left = None, [], len(streams)
    try:
        while left:
            i, chunk = await queue.get()
            if chunk is StopAsyncIteration:
                left -= 1
            elif chunk is None:
                yield ": keep-alive\n\n"
            elif "error" in chunk:
                yield sse(chunk) + "data: [DONE]\n\n"
                return
            elif not chunk.get("choices") and chunk.get("usage"):
                usages.append(chunk)
            else:
                head = head or {k: chunk[k] for k in ("id", "created")}
                yield sse(dict(chunk, **head, choices=[dict(c, index=i) for c in chunk["choices"]]))
        if usages:
            first = usages[0]["usage"]
            completion = sum(u["usage"]["completion_tokens"] for u in usages)
            yield sse(dict(usages[0], **(head or {}), usage=dict(first, completion_tokens=completion,
                                                               total_tokens=first["prompt_tokens"] + completion)))
        yield "data: [DONE]\n\n"
    finally:   # (a client gone, an error): every choice's session ends now
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.body_iterator.aclose()
