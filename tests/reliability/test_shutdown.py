"""SIGTERM under load: every client gets its answer (or an error), none waits for its own timeout.

The server is the session's live ``preft serve`` (``tests/live_server.py``; ``--drain-seconds``
at its default of 30): this test is its last user and ends it."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from live_server import API_KEY
from preft.eval.harness.server_process import stop_server


@pytest.mark.slow
@pytest.mark.stops_live_server
def test_sigterm_under_load_drains_running_requests(server):
    proc, url = server["proc"], server["url"]
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(index: int):
            try:
                response = await client.completions.create(model="base", prompt=f"add {index} 2 =", max_tokens=96,
                                                           temperature=0.0, extra_body={"ignore_eos": True})
                return ("answer", len(response.choices[0].text) > 0, time.time())
            except openai.APIError as err:  # refused or cut off: an error, promptly
                return ("error", type(err).__name__, time.time())

        async def load_then_terminate():
            jobs = [asyncio.create_task(one(i)) for i in range(40)]
            await asyncio.sleep(2.0)  # requests are running
            sent = time.time()
            proc.terminate()
            results = await asyncio.gather(*jobs)
            await client.close()
            return sent, results

        sent, results = asyncio.run(load_then_terminate())
        assert proc.wait(timeout=60) is not None
        finished = [r for r in results if r[0] == "answer"]
        assert all(ok for _, ok, _ in finished)
        # the running requests were drained (answered), and nobody waited anywhere near the client timeout
        assert len(finished) >= 20, results
        assert max(t for *_, t in results) - sent < 40, results
    finally:
        if proc.poll() is None:
            stop_server(proc)
