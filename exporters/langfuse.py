"""Langfuse, through its own SDK (OpenTelemetry underneath): a trace per trajectory, a generation
per model turn with its token usage, a tool observation per tool call, the reward as a score."""

from __future__ import annotations

import math
import threading
from typing import Any

from exporters.base import ExportConfigError, Outcome, env, missing_sdk, require
from exporters.flatten import Item, initial_messages, turns

CHUNK = 32  # trajectories between flushes: bounds what the SDK's span queue holds (it drops silently past 2048)
# The SDK keeps one set of resources per public key for the whole process (a second client with the
# same key gets the first one's span exporter and host), so exporters with one key share one client.
_CLIENTS: dict[str, tuple[Any, "_CountingExporter", tuple[str, str]]] = {}
_LOCK = threading.Lock()


class _CountingExporter:
    """Wraps the OTLP exporter: the SDK swallows export failures, and the operator wants them counted."""

    def __init__(self, inner: Any):
        self.inner, self.failures, self.last_error = inner, 0, None
        self._lock = threading.Lock()

    def export(self, spans):  # noqa: ANN001 - OpenTelemetry's SpanExporter interface
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter that raises must still be counted, not kill the processor
            result, self.last_error = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        if result != SpanExportResult.SUCCESS:
            with self._lock:
                self.failures += 1
                self.last_error = self.last_error or "OTLP export failed (endpoint down, slow, or refused the spans)"
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def take_failure(self) -> str | None:
        with self._lock:
            if not self.failures:
                return None
            self.failures, err, self.last_error = 0, self.last_error, None
            return err


class LangfuseExporter:
    name = "langfuse"

    def __init__(self, public_key: str | None = None, secret_key: str | None = None, host: str | None = None,
                 timeout: float = 10.0):
        public_key = require(public_key or env("LANGFUSE_PUBLIC_KEY"), "LANGFUSE_PUBLIC_KEY", self.name)
        secret_key = require(secret_key or env("LANGFUSE_SECRET_KEY"), "LANGFUSE_SECRET_KEY", self.name)
        host = (host or env("LANGFUSE_BASE_URL", "LANGFUSE_HOST", default="https://cloud.langfuse.com")).rstrip("/")
        try:
            import base64

            from langfuse import Langfuse
            from opentelemetry.exporter.otlp.proto.http import Compression
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace import TracerProvider
        except ImportError:
            raise missing_sdk("langfuse", self.name) from None
        with _LOCK:
            if public_key in _CLIENTS and _CLIENTS[public_key][2] != (secret_key, host):
                raise ExportConfigError(f"the Langfuse SDK keeps one client per public key in a process; "
                                        f"{public_key} is already sending to {_CLIENTS[public_key][2][1]}")
            if public_key not in _CLIENTS:
                auth = base64.b64encode(f"{public_key}:{secret_key}".encode()).decode()
                # Langfuse's documented OTLP endpoint and headers, as its SDK builds them itself.
                spans = _CountingExporter(OTLPSpanExporter(
                    endpoint=f"{host}/api/public/otel/v1/traces", timeout=timeout, compression=Compression.Gzip,
                    headers={"Authorization": f"Basic {auth}", "x-langfuse-public-key": public_key,
                             "x-langfuse-sdk-name": "python", "x-langfuse-ingestion-version": "4"}))
                # A provider of our own: never the application's global one, whose spans are not ours.
                client = Langfuse(public_key=public_key, secret_key=secret_key, base_url=host,
                                  timeout=max(1, math.ceil(timeout)), span_exporter=spans,
                                  tracer_provider=TracerProvider())
                _CLIENTS[public_key] = (client, spans, (secret_key, host))
            self._lf, self._spans, _ = _CLIENTS[public_key]
        self.host = host

    def export(self, items: list[Item]) -> Outcome:
        out = Outcome()
        for start in range(0, len(items), CHUNK):
            chunk = items[start:start + CHUNK]
            try:
                for item in chunk:
                    self._trace(item)
                self._lf.flush()
            except Exception as exc:
                out.fail(len(chunk), exc)
                continue
            err = self._spans.take_failure()
            if err is not None:
                # Down or too slow: the rest would wait the same timeout, so they are counted, not tried.
                out.failed += len(items) - start
                out.error = err
                break
            out.exported += len(chunk)
        return out

    def _trace(self, item: Item) -> None:
        from langfuse import Langfuse, propagate_attributes

        t = item.trajectory
        trace_id = Langfuse.create_trace_id(seed=item.key)  # re-exporting a trajectory lands on its trace
        meta = {"metrics": t.metrics, "metadata": t.metadata, "start_time": t.start_time, "end_time": t.end_time,
                "logs": t.logs or None, **item.tags()}
        with self._lf.start_as_current_observation(trace_context={"trace_id": trace_id}, name="trajectory",
                                                   as_type="agent", input=initial_messages(t), metadata=meta) as root:
            with propagate_attributes(trace_name=item.run, session_id=f"{item.run}/step-{item.step}",
                                      tags=[f"run:{item.run}", f"split:{item.split}", f"step:{item.step}"],
                                      metadata=item.tags()):
                for turn in turns(t):
                    usage = {k: v for k, v in (("input", turn.prompt_tokens), ("output", turn.completion_tokens)) if v is not None}
                    if len(usage) == 2:
                        usage["total"] = usage["input"] + usage["output"]
                    self._lf.start_observation(
                        name=f"turn {turn.index}", as_type="generation", input=turn.request, output=turn.output,
                        model=turn.model, model_parameters=turn.parameters, usage_details=usage,
                        metadata={"finish_reason": turn.finish_reason, "policy_step": turn.policy_step}).end()
                    for call in turn.tool_calls:
                        self._lf.start_observation(name=call.name, as_type="tool", input=call.arguments,
                                                   output=call.result, metadata={"tool_call_id": call.id}).end()
                root.update(output={"reward": t.reward, "final_message": (t.messages() or [None])[-1]})
                root.score_trace(name="reward", value=float(t.reward), data_type="NUMERIC")

    def close(self) -> None:
        # Flushed, not shut down: the client is shared (see _CLIENTS); the SDK shuts it down at exit.
        try:
            self._lf.flush()
        except Exception:  # closing must not fail the caller's shutdown
            pass
