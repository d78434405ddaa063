"""The server driven from its own OpenAPI document: schemathesis generates requests (valid ones,
and ones that break the schema) for every route, and none may get a 5xx.

Routes are tried with data in place, so reads find something: a run with a trained step and
logged groups. Generated chat requests are capped to a few tokens so a bounded number of examples
per route fits inside `make test`.
"""

from __future__ import annotations

import asyncio

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from client import TrainConfig, TrainableModel
from tests.test_training_service import _groups, _with_rewards

EXAMPLES_PER_ROUTE = 25


@pytest.fixture(scope="module")
def fuzzed_server(fresh_server_module):
    srv = fresh_server_module()

    async def seed():
        model = await TrainableModel("fuzzed").register(srv.url)
        groups = _with_rewards(await _groups(model, 1, 2, seed=6), [[0.0, 1.0]])
        await model.train(groups, TrainConfig(learning_rate=1e-3))
        await model.log(groups, split="val")
    asyncio.run(seed())
    return srv


def _short(body):
    # Keep generated completions short: the point is the server's answer, not the model's.
    if isinstance(body, dict) and "messages" in body:
        body["max_tokens"] = 4
        body["n"] = 1
        body.pop("max_completion_tokens", None)


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error(fuzzed_server, mode):
    failures: list[str] = []
    operations = _operations(fuzzed_server.url)
    assert len(operations) >= 20  # every route is described (the page and its files are not API)
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            _short(case.body)
            response = case.call(base_url=fuzzed_server.url, timeout=120)
            if response.status_code >= 500:
                failures.append(f"{operation.method.upper()} {operation.path} -> {response.status_code}: "
                                f"{response.text[:300]} for {case.as_curl_command()[:500]}")

        try:
            run()
        except Unsatisfiable:  # nothing in this route's schema can be broken (no parameters, no body)
            assert mode is GenerationMode.NEGATIVE, operation.path
    assert failures == [], "\n".join(failures[:10])
