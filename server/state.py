"""The parts of one art-server, as every request sees them (server/app.py's build_state makes
them). Whether a caller may see a run is its owners' rule: `state.runs.owners.visible`
(server/runs/ownership.py)."""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.base import Engine
from server.export_queue import ExportQueue
from server.harness.responses import ResponseStore
from server.harness.sessions import Sessions
from server.model.host import ModelHost
from server.runs.facade import Runs
from server.sampling.served_names import ServedModels
from server.settings import Settings
from server.store import Store
from server.training.jobs import JobManager


@dataclass
class ServerState:
    settings: Settings
    host: ModelHost
    engine: Engine
    served: ServedModels
    runs: Runs
    store: Store
    jobs: JobManager
    sessions: Sessions
    responses: ResponseStore  # for previous_response_id
    export_queue: ExportQueue | None = None  # when --export asks for exporters

