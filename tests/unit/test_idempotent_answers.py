"""services/gateway/idempotent.py: a resent call (same key, X-Idempotency-Key, route and request)
shares the first call's answer; refusals are not kept; old answers are forgotten."""

import asyncio
from types import SimpleNamespace

import pytest

from temper.services.gateway.idempotent import RecentAnswers, once_per_request


def fake_request(idempotency: str | None, path: str = "/api/v1/x", method: str = "PUT"):
    headers = {"x-idempotency-key": idempotency} if idempotency else {}
    return SimpleNamespace(headers=headers, method=method, url=SimpleNamespace(path=path), app=SimpleNamespace(state=SimpleNamespace()))


def test_a_resend_shares_the_first_answer_and_anything_else_runs_again():
    calls = []

    async def main():
        app_state = SimpleNamespace()

        def req(idempotency, path="/api/v1/x"):
            r = fake_request(idempotency, path)
            r.app.state = app_state
            return r

        async def make():
            calls.append(1)
            await asyncio.sleep(0.01)
            return len(calls)

        together = await asyncio.gather(once_per_request(req("a"), "k", b"body", make), once_per_request(req("a"), "k", b"body", make))
        later = await once_per_request(req("a"), "k", b"body", make)
        others = [await once_per_request(req("a"), "k2", b"body", make),            # another API key
                  await once_per_request(req("a"), "k", b"other body", make),       # another request
                  await once_per_request(req("a", "/api/v1/y"), "k", b"body", make),  # another route
                  await once_per_request(req("b"), "k", b"body", make),             # another idempotency key
                  await once_per_request(req(None), "k", b"body", make),            # no header: always runs
                  await once_per_request(req(None), "k", b"body", make)]
        return together, later, others

    together, later, others = asyncio.run(main())
    assert together == [1, 1] and later == 1
    assert others == [2, 3, 4, 5, 6, 7] and len(calls) == 7


def test_a_refusal_is_not_kept_and_old_answers_are_forgotten():
    answers = RecentAnswers(keep_seconds=0.05, max_kept=2)
    attempts = []

    async def refused():
        attempts.append("refused")
        raise ValueError("no")

    async def fine():
        attempts.append("fine")
        return "ok"

    async def main():
        with pytest.raises(ValueError):
            await answers.once("r", refused)
        assert await answers.once("r", fine) == "ok"  # the resend tried again
        assert await answers.once("r", refused) == "ok"  # and is now kept
        await asyncio.sleep(0.06)
        assert await answers.once("r", fine) == "ok" and attempts[-1] == "fine"  # expired: runs again
        for identity in ("s", "t", "u"):
            await answers.once(identity, fine)
        assert len(answers.answers) <= 2  # the oldest went first

    asyncio.run(main())
    assert attempts[:2] == ["refused", "fine"]
