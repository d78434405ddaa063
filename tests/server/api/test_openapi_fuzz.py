"""The server driven from its own OpenAPI document: schemathesis generates requests (valid ones,
and ones that break the schema) for every route, and none may get a 5xx. Beside the random draws,
its coverage phase: for each route, every boundary and wrong type its schema allows one to name
(the least float above a bound, a list where a string goes), each once, so the sweep does not depend on luck.

Routes are tried with data in place, so reads find something: a run with a trained step and
logged groups. Generated chat requests are capped to a few tokens so a bounded number of examples
per route fits inside `make test`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from urllib.parse import quote

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from client import TrainConfig, TrainableModel
from tests.helpers import demo_groups, with_rewards

EXAMPLES_PER_ROUTE = 12  # per route and mode in `make test`; `make test-fuzz` sends 5,000 cases
INT64 = 2**63 - 1


@pytest.fixture(scope="module")
async def fuzzed_server(fresh_server_module):
    srv = fresh_server_module()
    model = await TrainableModel("fuzzed").register(srv.url)
    groups = with_rewards(await demo_groups(model, 1, 2, seed=6), [[0.0, 1.0]])
    await model.train(groups, TrainConfig(learning_rate=1e-3))
    await model.log(groups, split="val")
    return srv


def _short(body):
    # Keep generated completions short: the point is the server's answer, not the model's.
    if isinstance(body, dict) and "token_ids" in body:  # the token-in route
        sp = body.setdefault("sampling_params", {})
        if isinstance(sp, dict):
            sp["max_tokens"] = 4
    if isinstance(body, dict) and "messages" in body:
        body["max_tokens"] = 4
        body["n"] = 1
        body.pop("max_completion_tokens", None)
    if isinstance(body, dict) and "input" in body:  # the Responses API
        body["max_output_tokens"] = 4


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz(url: str, mode: GenerationMode, per_route: int,
          derandomize: bool = True) -> tuple[list[str], dict[tuple[str, str], set[int]], int]:
    """Generated requests for every route: (5xx failures, status codes seen per operation, cases sent)."""
    failures: list[str] = []
    seen: dict[tuple[str, str], set[int]] = {}
    sent = 0
    operations = _operations(url)
    assert len(operations) >= 20  # every route is described (the page and its files are not API)
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=per_route, deadline=None, derandomize=derandomize, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            nonlocal sent
            _short(case.body)
            sent += 1
            _answered(operation, case, case.call(base_url=url, timeout=120), seen, failures)

        try:
            run()
        except Unsatisfiable:  # nothing in this route's schema can be broken (no parameters, no body)
            assert mode is GenerationMode.NEGATIVE, operation.path
    return failures, seen, sent


def _coverage_cases(url: str):
    """schemathesis's coverage phase for every route: (operation, case), valid cases and invalid ones."""
    for operation in _operations(url):
        generation = operation.schema.config.generation_for(operation=operation, phase="coverage")
        for case in operation.schema.iter_coverage_cases(operation, generation_modes=list(GenerationMode),
                                                         generation_config=generation, extra_data_source=None,
                                                         error_feedback=None, session=None):
            yield operation, case


def _no_route(response) -> bool:
    """A 404 of the router: the path matched no route, so no operation's documented codes apply."""
    if response.status_code != 404:
        return False
    return response.json()["error"]["code"] == "unknown_route"


def _answered(operation, case, response, seen: dict[tuple[str, str], set[int]], failures: list[str]) -> None:
    """The code an operation answered a case with, kept; a 5xx, a failure. The coverage phase's probes
    of a method the route lacks answer for another route or none, as does a path with an empty or
    slashed segment: only their no-5xx counts."""
    if case.method.upper() == operation.method.upper() and not _no_route(response):
        seen.setdefault((operation.method.upper(), operation.path), set()).add(response.status_code)
    if response.status_code >= 500:
        failures.append(f"{operation.method.upper()} {operation.path} -> {response.status_code}: "
                        f"{response.text[:300]} for {case.as_curl_command()[:500]}")


def _undocumented(url: str, seen: dict[tuple[str, str], set[int]]) -> list[str]:
    """Status codes an operation answered that its published responses do not list."""
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    return [f"{method} {path} -> {status}" for (method, path), statuses in sorted(seen.items())
            for status in sorted(statuses) if str(status) not in paths[path][method.lower()]["responses"]]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error(fuzzed_server, mode):
    """And every status code a generated request gets is one the OpenAPI document lists for its route."""
    failures, seen, _ = _fuzz(fuzzed_server.url, mode, EXAMPLES_PER_ROUTE)
    assert failures == [], "\n".join(failures[:10])
    assert _undocumented(fuzzed_server.url, seen) == []


def _ground(case, run: str) -> bool:
    """The case pointed at a run that exists (generated names mostly get a 404 before any check of
    the body runs); False where nothing names a run, or for a delete (it would delete the run)."""
    if case.method.upper() == "DELETE":
        return False
    named = "name" in (case.path_parameters or {}), isinstance(case.body, dict) and "model" in case.body
    if named[0]:
        case.path_parameters["name"] = run
    if named[1]:
        case.body["model"] = run
    return any(named)


async def test_no_boundary_case_of_the_coverage_phase_gets_a_server_error(fuzzed_server):
    """Every case of schemathesis's coverage phase (about 8,000, each also sent to a run that exists)
    gets a documented 2xx or 4xx; a top_p of 5e-324 and a list as a tool call's id were 500s that 12
    random draws per route never sent."""
    await TrainableModel("swept").register(fuzzed_server.url)
    failures, seen, sent = [], {}, Counter()

    def send(operation, case, session) -> None:
        response = case.call(base_url=fuzzed_server.url, session=session, timeout=120)
        sent[response.status_code // 100] += 1
        _answered(operation, case, response, seen, failures)

    with requests.Session() as session:  # schemathesis sends with requests
        for operation, case in _coverage_cases(fuzzed_server.url):
            _short(case.body)
            send(operation, case, session)  # as generated
            if _ground(case, "swept"):
                send(operation, case, session)  # then pointed at the run
    assert failures == [], "\n".join(failures[:10])
    assert sent[2] > 500 and sent[4] > 5000, sent  # valid cases got through, and broken ones were refused
    undocumented = _undocumented(fuzzed_server.url, seen)
    assert undocumented == [], "\n".join(undocumented)


@pytest.mark.skipif(not os.environ.get("ARTISAN_FUZZ_CASES"), reason="the long fuzz: ARTISAN_FUZZ_CASES=5000")
def test_a_long_fuzz_gets_no_server_error_and_only_documented_codes(fuzzed_server):
    """`ARTISAN_FUZZ_CASES=5000 pytest tests/server/api/test_openapi_fuzz.py -k long_fuzz -s`: at least that many
    generated cases, half valid and half breaking the schema; prints one JSON line of what it did."""
    wanted = int(os.environ["ARTISAN_FUZZ_CASES"])
    routes = len(_operations(fuzzed_server.url))
    start, failures, seen, sent = time.monotonic(), [], {}, 0
    while sent < wanted:  # routes with few distinct cases end early: rounds go on, with new draws, until enough
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            f, s, n = _fuzz(fuzzed_server.url, mode, math.ceil((wanted - sent) / (2 * routes)) + 1, derandomize=False)
            failures += f
            sent += n
            for key, codes in s.items():
                seen.setdefault(key, set()).update(codes)
    codes = Counter(c for statuses in seen.values() for c in statuses)
    print(json.dumps({"cases": sent, "seconds": round(time.monotonic() - start, 1), "server_errors": len(failures),
                      "routes_per_status_code": dict(sorted(codes.items()))}))
    assert failures == [], "\n".join(failures[:10])
    assert _undocumented(fuzzed_server.url, seen) == []


# ---- what the generated cases above rarely reach: huge integers and text that is not valid UTF-8 --------

# Lone surrogates, non-BMP characters, NUL and template-looking text, in any mix; strings from JSON
# escapes ("\\ud800") reach the server as str, so nothing upstream filters them.
WILD_TEXT = (st.lists(st.sampled_from(["\ud800", "\udfff", "\U0001F600", "\U00010000", "\x00", "{{ x }}", "a", "é"]),
                      max_size=6).map("".join)
             | st.text(st.characters(exclude_categories=()), max_size=8))
HUGE_INT = st.integers(INT64 - 2, 2**80) | st.integers(-2**80, -1) | st.integers(0, 3)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)


def _send(client: httpx.Client, method: str, path: str, body=None, **kw) -> httpx.Response:
    content = None if body is None else json.dumps(body, allow_nan=True)  # ASCII: surrogates as escapes
    return client.request(method, path, content=content, headers={"content-type": "application/json"}, **kw)


def _segment(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")  # a surrogate as the bytes a client may send


@st.composite
def _log_bodies(draw):
    meta = draw(st.dictionaries(WILD_TEXT, WILD_TEXT | HUGE_INT | ANY_FLOAT, max_size=3))
    trajectory = {"messages_and_choices": [{"role": "user", "content": draw(WILD_TEXT)},
                                           {"role": "assistant", "content": draw(WILD_TEXT)}],
                  "reward": draw(ANY_FLOAT | HUGE_INT), "metadata": meta}
    return {"groups": [{"trajectories": [trajectory]}], "split": draw(st.just("val") | WILD_TEXT),
            "step": draw(st.none() | HUGE_INT)}


@st.composite
def _import_lines(draw, line: dict):
    rec = json.loads(json.dumps(line))
    for key in ("step", "group_index", "traj_index"):
        rec[key] = draw(HUGE_INT)
    rec["split"] = draw(st.just("train") | WILD_TEXT)
    rec["trajectory"]["metadata"] = {draw(WILD_TEXT): draw(WILD_TEXT | HUGE_INT)}
    return json.dumps(rec, allow_nan=True)


@st.composite
def _ui_reads(draw):
    name, number = _segment(draw(st.just("fuzzed") | WILD_TEXT.filter(bool))), draw(HUGE_INT)
    path = draw(st.sampled_from([f"/ui/api/runs/{name}", f"/ui/api/runs/{name}/steps/{number}/groups",
                                 f"/ui/api/runs/{name}/trajectories", f"/ui/api/trajectories/{number}",
                                 f"/v1/runs/{name}/trajectories"]))
    query = draw(st.dictionaries(st.sampled_from(["step", "split", "group", "q", "meta_key", "meta_value", "limit"]),
                                 (WILD_TEXT | HUGE_INT).map(str), max_size=3))
    return path + "?" + "&".join(f"{k}={_segment(v)}" for k, v in query.items())


def test_log_import_and_the_ui_take_huge_integers_and_any_text(fuzzed_server):
    """Whatever /log, /import and the UI's reads are sent, the answer is never a 5xx, and what was
    stored can still be read back afterwards."""
    failures: list[str] = []
    stored_or_read: Counter[str] = Counter()  # the cases that got through: the test is not all 400s
    wild = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
    with httpx.Client(base_url=fuzzed_server.url, timeout=60) as client:
        line = json.loads(client.get("/v1/runs/fuzzed/export.jsonl").text.splitlines()[0])

        def check(r: httpx.Response, what: str) -> None:
            stored_or_read[what.split()[0]] += r.status_code == 200
            if r.status_code >= 500:
                failures.append(f"{what} -> {r.status_code}: {r.text[:200]}")

        @wild
        @given(body=_log_bodies())
        def log(body):
            check(_send(client, "POST", "/v1/runs/fuzzed/log", body), f"log {body!r:.300}")

        @wild
        @given(text=_import_lines(line))
        def import_(text):
            r = client.post("/v1/runs/fuzzed/import", content=text.encode("utf-8", "surrogatepass"))
            check(r, f"import {text[:300]!r}")

        @wild
        @given(path=_ui_reads())
        def read(path):
            check(client.get(path), f"GET {path[:300]}")

        log(), import_(), read()
        assert failures == [], "\n".join(failures[:10])
        assert all(stored_or_read[k] > 0 for k in ("log", "import", "GET")), stored_or_read
        for path in ("/v1/runs/fuzzed/trajectories", "/ui/api/runs/fuzzed", "/ui/api/runs/fuzzed/trajectories",
                     "/ui/api/runs/fuzzed/steps/1/groups", "/v1/runs/fuzzed/export.jsonl"):
            assert client.get(path).status_code == 200, path
