"""OutputSink: a request's outputs that wait for its handler are merged (deltas appended in order,
the rest the newest's); errors and other requests' outputs keep their places, and nothing merges
ahead of an error."""

from __future__ import annotations

import asyncio

from zipage_jax.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from zipage_jax.server.output_sink import OutputSink


def output(request_id: str, ids: list[int], text: str, finished: bool = False, logprobs: bool = False):
    lps = [TokenLogprob(i, -1.0, []) for i in ids] if logprobs else None
    completion = CompletionOutput(0, "all" if finished else "", ids if finished else [], "length" if finished else None,
                                  delta_text=text, delta_token_ids=ids, delta_logprobs=lps, metrics={"n": len(ids)})
    return RequestOutput(request_id, None, [1], [completion], finished)


def test_outputs_waiting_for_the_handler_merge():
    async def main():
        sink = OutputSink()
        sink.put_nowait(output("a", [1], "x", logprobs=True))
        sink.put_nowait(output("b", [9], "q"))
        sink.put_nowait(output("a", [2, 3], "yz", logprobs=True))
        sink.put_nowait(output("a", [4], "!", finished=True, logprobs=True))
        error = RuntimeError("failed")
        sink.put_nowait(error)
        sink.put_nowait(output("b", [10], "r"))
        first = await sink.get()
        o = first.outputs[0]
        assert (first.request_id, o.delta_token_ids, o.delta_text) == ("a", [1, 2, 3, 4], "xyz!")
        assert [lp.token_id for lp in o.delta_logprobs] == [1, 2, 3, 4]
        assert first.finished and o.text == "all" and o.finish_reason == "length" and o.metrics == {"n": 1}
        assert (await sink.get()).outputs[0].delta_token_ids == [9]
        assert await sink.get() is error
        assert (await sink.get()).outputs[0].delta_token_ids == [10]  # after the error, not merged before it
        sink.put_nowait(output("a", [5], "w"))  # nothing waits now: a new entry
        waiter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        assert (await waiter).outputs[0].delta_token_ids == [5]
        late = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0.01)
        assert not late.done()
        sink.put_nowait(output("c", [6], "v"))
        assert (await late).request_id == "c"

    asyncio.run(main())
