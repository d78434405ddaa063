"""The torch engine: one background thread decodes every running sequence together.

Each loop iteration admits waiting sequences (short prompts prefilled together whatever their
lengths, each distinct prompt once; a long prompt first takes what it can from the prefix cache,
then prefills the rest), then runs one decode step for all rows, then retires the finished ones,
whose K/V (prompt and reply) the prefix cache keeps for the next turn. New requests therefore
join at the next step boundary instead of waiting for a batch to drain, and 32 concurrent rollouts
cost about one batched generate. One request never holds more than half the rows, so a large `n`
cannot shut everyone else out.

The rows' K/V has a budget (`--kv-cache-mb`) besides the row count: a waiting row joins only while
the batch's K/V with it (every row as wide as the widest, since rows are right-aligned) stays within
it, and a row that does not fit keeps its place at the head of the queue: rows are otherwise
bounded by count alone, and 64 rows of a long-context agent's turns (4-8k tokens) hold 12-24 GB
of K/V on SmolLM2-135M (`bench/memory.py --long-prompts N` measures it). The budget is checked as
rows join; rows already decoding keep growing by one column a step.

A retired row leaves its slot in the batch free rather than copying the batch's K/V without it,
and rows that join take free slots when their prompts fit (copying only their own K/V): agents
finish turns one by one and send the next a tool call later. Joining rows that do not fit are
appended (one copy), and the batch is compacted only when more slots are free than in use; a free
slot is decoded with the others meanwhile, which on weights-bound decode steps costs little.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from server.engine.base import EngineError, EngineFull, GenRequest, DecodeSequence, record_token
from server.engine.constraints import ConstraintState
from server.engine.kv_cache import HEADROOM, BatchKV
from server.engine.prefix_cache import Hit, PrefixCache, RowState
from server.engine.sampling import sample
from server.model.architecture import continues_from_cache, kv_shape
from server.model.threads import own_threads
from server.model.memory import available_memory, trim
from server.model.host import ModelHost

if TYPE_CHECKING:
    from server.settings import Settings

log = logging.getLogger("artisan.engine")


# Padded tokens of one prefill forward of short prompts: a bound on its activations.
PREFILL_TOKENS = 8192
# The rows' K/V budget by default: this fraction of the device's available memory at the start
# (a join briefly doubles it, and the prefix cache and a long prompt's prefill come on top), but
# not below the floor: a server started beside a busy trainer still decodes 64 rows of short prompts
# and four of tau2's 8k-token turns.
KV_SHARE = 8
KV_FLOOR_MB = 2048
# A CPU decode step of this many rows or fewer runs on the engine's thread alone (server/model/threads.py).
# SmolLM2-135M in process on the 2-core machine under PASSIVE, one thread against both, six paired
# requests each: 1.07x the tokens a second at 1 row, 1.25x at 2, 1.26x at 4, 1.02x at 8.
FEW_ROWS = 4


def _chunks(groups: list[list[DecodeSequence]], budget: int) -> list[list[list[DecodeSequence]]]:
    """Consecutive runs of `groups` (sorted by prompt length) whose padded size stays within `budget`."""
    chunks: list[list[list[DecodeSequence]]] = []
    for g in groups:
        length = len(g[0].request.prompt_ids)
        if chunks and length * (len(chunks[-1]) + 1) <= budget:
            chunks[-1].append(g)
        else:
            chunks.append([g])
    return chunks


class TorchEngine:
    max_lora_rank = None

    def __init__(self, host: ModelHost, max_batch: int, max_waiting: int, prefix_cache_mb: int, kv_cache_mb: int,
                 prefix_state_every: int):
        self.host = host
        self._cached = kv_shape(host.base_model)  # what each layer caches per token
        # A layer's state (Qwen3.5's linear attention) holds a whole prefix and cannot be cut back to a
        # shorter one: such a model reuses a cached prefix up to where its states were kept, where its
        # forward continues one.
        stateful = "state" in self._cached.kinds
        cacheable = not stateful or continues_from_cache(host.base_model)
        self.prefix = PrefixCache(prefix_cache_mb * 2**20 if cacheable else 0, stateful=stateful,
                                  checkpoint_every=prefix_state_every)
        self.max_batch = max_batch
        self.kv_budget = kv_cache_mb * 2**20
        self.max_waiting = max_waiting
        self.rows_per_request = max(1, max_batch // 2)
        self._waiting: deque[DecodeSequence] = deque()
        self._rows: list[DecodeSequence | None] = []  # the batch's slots (None: free); [] when none runs
        self._kv: BatchKV | None = None
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="artisan-engine", daemon=True)
        self.text_of: Callable[[list[int]], str] = host.chat.text  # the text stop strings are matched in
        # One column of one row: its key and value in every layer.
        c = self._cached
        self._column_bytes = c.layers * (c.heads * c.head_dim + c.value_heads * c.value_dim) * host.dtype.itemsize

    @classmethod
    def from_settings(cls, host: ModelHost, settings: Settings) -> TorchEngine:
        kv_cache_mb = settings.kv_cache_mb or max(KV_FLOOR_MB, available_memory(host.device) // KV_SHARE // 2**20)
        return cls(host, max_batch=settings.max_batch, max_waiting=settings.max_waiting,
                   prefix_cache_mb=settings.prefix_cache_mb, kv_cache_mb=kv_cache_mb,
                   prefix_state_every=settings.prefix_state_every)

    # ---- Engine ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def submit(self, req: GenRequest) -> None:
        with self._cv:
            if len(self._waiting) + req.n > self.max_waiting:
                raise EngineFull(f"{len(self._waiting)} sequences are waiting (limit {self.max_waiting})")
            req.sequences = [DecodeSequence(req, i, generator=self._generator(req, i),
                                      constraint=req.params.constraint and ConstraintState(self.host.chat, req.params.constraint))
                             for i in range(req.n)]
            self._waiting.extend(req.sequences)
            self._cv.notify_all()

    def check(self, params: Any) -> None:
        pass  # logprobs are taken before top-p and grammar masks here, so every setting is exact

    def load_adapter(self, name: str, lora_config: Any, state: dict[str, Any]) -> None:
        with self.host.lock:
            self.prefix.drop(name)
            self.host.delete_adapter(name)
            self.host.add_adapter(name, lora_config, state)

    def unload_adapter(self, name: str) -> None:
        with self.host.lock:
            self.prefix.drop(name)
            self.host.delete_adapter(name)

    @property
    def load(self) -> dict[str, Any]:
        kv = self._kv
        return {"running": len(self._live()), "waiting": len(self._waiting), "prefix_cache": self.prefix.figures,
                "kv_cache": {"budget_mb": self.kv_budget // 2**20, "held_mb": (kv.nbytes if kv else 0) // 2**20}}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _generator(self, req: GenRequest, i: int) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        g = torch.Generator(device=self.host.device)
        g.manual_seed((req.params.seed + i) % 2**64)  # torch takes [0, 2**64)
        return g

    # ---- loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self._waiting and not self._rows:
                    self._cv.wait()
                if self._stopped:
                    return
                admitted = self._admit()
            try:
                with self.host.lock, torch.inference_mode():
                    self._step(admitted)
            except Exception as exc:  # a failed forward fails its requests, not the server
                log.exception("engine step failed")
                for req in {id(s.request): s.request for s in self._live() + admitted}.values():
                    req.emit("error", exc)
                self._rows, self._kv = [], None
            if not self._rows and not self._waiting:
                trim()  # the batch's K/V and prefill buffers go back to the machine while nothing decodes

    def _step(self, admitted: list[DecodeSequence]) -> None:
        """One iteration's work on the model: prefill the admitted sequences, then one decode step."""
        self._prefill(admitted)
        self._drop_cancelled()
        if self._rows:
            self._decode_step()

    def _admit(self) -> list[DecodeSequence]:
        """Waiting sequences in arrival order, as rows and the K/V budget allow, at most
        `rows_per_request` each. A batch with no row takes the first whatever its size."""
        live = self._live()
        free, rows = self.max_batch - len(live), len(live)
        slots = len(self._rows)  # a retired row's slot keeps its K/V until the batch is compacted
        width = self._kv.width if self._kv is not None else 0
        held: dict[int, int] = {}
        for s in live:
            held[s.request.id] = held.get(s.request.id, 0) + 1
        admitted, deferred = [], deque()
        while self._waiting and free > 0:
            s = self._waiting.popleft()
            if s.request.cancelled:
                continue
            if held.get(s.request.id, 0) >= self.rows_per_request:
                deferred.append(s)
                continue
            wider = max(width, len(s.request.prompt_ids))
            if rows and self.kv_bytes(max(slots, rows + 1), wider) > self.kv_budget:
                self._waiting.appendleft(s)  # first in line once rows retire
                break
            held[s.request.id] = held.get(s.request.id, 0) + 1
            admitted.append(s)
            free, rows, width = free - 1, rows + 1, wider
        self._waiting.extendleft(reversed(deferred))
        return admitted

    def kv_bytes(self, rows: int, width: int) -> int:
        """The K/V of `rows` right-aligned rows `width` columns wide, with the columns allocated past it,
        and their layers' states."""
        return rows * ((width + HEADROOM) * self._column_bytes + self._cached.state_bytes)

    def _prefill(self, seqs: list[DecodeSequence]) -> None:
        by_prompt: dict[tuple, list[DecodeSequence]] = {}  # (adapter, ids) -> the rows that sample from it
        for s in seqs:
            by_prompt.setdefault((s.request.policy.adapter, tuple(s.request.prompt_ids)), []).append(s)
        long = {key: group for key, group in by_prompt.items() if self.prefix.wants(group[0].request.prompt_ids)}
        short = [group for key, group in by_prompt.items() if key not in long]
        for chunk in _chunks(sorted(short, key=lambda g: len(g[0].request.prompt_ids)), PREFILL_TOKENS):
            self._prefill_short(chunk)
        # One long prompt at a time, so that the next can reuse what this one adds.
        for (adapter, ids), group in long.items():
            self._prefill_long(group, self.prefix.find(adapter, group[0].request.prompt_ids))
        self._retire()

    def _prefill_short(self, groups: list[list[DecodeSequence]]) -> None:
        """Short prompts of any lengths in one forward, each computed once however many rows
        sample from it: left-padded so that they end together, as the batch's rows do."""
        prompts = [g[0].request.prompt_ids for g in groups]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt):] = torch.tensor(prompt)
            mask[r, width - len(prompt):] = 1
        ids, mask = ids.to(self.host.device), mask.to(self.host.device)
        kv = self._empty_kv(len(prompts), width)
        out = self.host.decode(ids, [g[0].request.policy.adapter for g in groups], past_key_values=kv.cache(),
                                use_cache=True, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                                logits_to_keep=1)
        kv.fill(width, [len(p) for p in prompts])
        rows = [r for r, g in enumerate(groups) for _ in g]  # a prompt's K/V and logits copied to each of its rows
        if len(rows) > len(groups):
            kv.keep(rows)
        self._join([s for g in groups for s in g], kv, out.logits[rows, -1, :])

    def _prefill_long(self, group: list[DecodeSequence], hit: Hit | None) -> None:
        """One long prompt, computed once after `hit`'s cached prefix however many rows sample from
        it (the samples of a request, the rollouts of a group), and kept in the prefix cache."""
        prompt, adapter = group[0].request.prompt_ids, group[0].request.policy.adapter
        kv, logits, checkpoints = self._forward_prompts(group[:1], hit)
        keys, values = [k[0, :, :len(prompt)] for k in kv.kbufs], [v[0, :, :len(prompt)] for v in kv.vbufs]
        states = kv.row_states(0)
        if hit is not None:  # the states it kept within the prefix this prompt shares hold for this one too
            checkpoints = {**hit.entry.states_within(hit.length), **checkpoints}
        self.prefix.add(adapter, prompt, [k.clone() for k in keys], [v.clone() for v in values], states, checkpoints)
        if len(group) > 1:
            kv = self._empty_kv(len(group), len(prompt))
            kv.write_prefix(keys, values, len(prompt), states)
            logits = logits.expand(len(group), -1).contiguous()
        self._join(group, kv, logits)

    def _forward_prompts(self, rows: list[DecodeSequence], hit: Hit | None
                         ) -> tuple[BatchKV, torch.Tensor, dict[int, list[RowState]]]:
        """Prefill prompts of one length after `hit`'s cached prefix: their K/V, the logits that
        sample each row's first token, and (where layers keep states) the first row's states at the
        prefix cache's checkpoints, the forward stopping at each."""
        length, start = len(rows[0].request.prompt_ids), hit.length if hit is not None else 0
        kv = self._empty_kv(len(rows), length)
        if hit is not None:
            kv.write_prefix(hit.entry.keys, hit.entry.values, start, hit.states)
        checkpoints: dict[int, list[RowState]] = {}
        for at, end in itertools.pairwise([start, *self.prefix.checkpoints(start, length), length]):
            ids = torch.tensor([s.request.prompt_ids[at:end] for s in rows], device=self.host.device)
            out = self.host.decode(
                ids, [s.request.policy.adapter for s in rows],
                past_key_values=kv.cache(), use_cache=True,
                attention_mask=torch.ones(len(rows), end, dtype=torch.long, device=ids.device),
                position_ids=torch.arange(at, end, device=ids.device)[None, :].expand(len(rows), -1),
                logits_to_keep=1,
            )
            kv.advance(end - at)
            if end < length:
                checkpoints[end] = kv.row_states(0)
        return kv, out.logits[:, -1, :], checkpoints

    def _empty_kv(self, rows: int, prompt_length: int) -> BatchKV:
        c = self._cached
        return BatchKV.empty(c.layers, rows, c.heads, c.head_dim, prompt_length + HEADROOM, self.host.dtype,
                             self.host.device, values=(c.value_heads, c.value_dim), kinds=c.kinds)

    def _live(self) -> list[DecodeSequence]:
        return [s for s in self._rows if s is not None]

    def _join(self, group: list[DecodeSequence], kv: BatchKV, logits: torch.Tensor) -> None:
        """Prefilled rows join the running batch, in free slots when their prompts fit in its width,
        and sample their first tokens."""
        if self._kv is None:
            self._kv, self._rows = kv, list(group)
        else:
            free = [i for i, s in enumerate(self._rows) if s is None]
            if len(free) >= len(group) and kv.width <= self._kv.width:
                self._kv.place(free[:len(group)], kv)
                for i, s in zip(free, group):
                    self._rows[i] = s
            else:  # appended (the one copy); free slots stay free until retiring compacts them
                self._kv.extend(kv)
                self._rows.extend(group)
        self._accept(group, logits)

    def _compact(self) -> None:
        """Drop the free slots: the one copy of the batch's K/V."""
        live = [i for i, s in enumerate(self._rows) if s is not None]
        if len(live) < len(self._rows):
            self._kv.keep(live)
            self._rows = [self._rows[i] for i in live]

    def _decode_step(self) -> None:
        few = len(self._rows) <= FEW_ROWS and self.host.device.type == "cpu"
        with own_threads(1 if few else None):
            self._decode_rows()

    def _decode_rows(self) -> None:
        kv = self._kv
        assert kv is not None
        kv.ensure_capacity(1)
        # A free slot decodes a padding token under a running row's adapter (no batch split by adapter).
        filler = next(s for s in self._rows if s is not None)
        rows = [s if s is not None else filler for s in self._rows]
        ids = torch.tensor([[s.token_ids[-1] if s is not None else 0] for s in self._rows], device=self.host.device)
        positions = torch.tensor(kv.lengths, device=ids.device)[:, None]
        logits = self.host.decode_step(ids, [s.request.policy.adapter for s in rows], kv.cache(),
                                       kv.attention_mask(extra=1), positions)
        kv.advance(1)
        live = [i for i, s in enumerate(self._rows) if s is not None]
        self._accept([self._rows[i] for i in live], logits[live])
        self._retire()

    def _accept(self, seqs: list[DecodeSequence], logits: torch.Tensor) -> None:
        """Sample one token per row, record it, and decide whether the row is done. A row whose
        logits are not finite (a poisoned adapter) fails alone; its batch-mates sample as usual."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        good = [i for i, ok in enumerate(finite) if ok]
        for i, ok in enumerate(finite):
            if not ok:
                seqs[i].finish_reason = "error"
        if not good:
            return
        rows = [seqs[i] for i in good]
        params = [s.request.params for s in rows]
        out = sample(logits[good], params, [s.generator for s in rows], top_k=max(p.top_logprobs for p in params),
                     allowed=self._allowed(rows, logits.shape[-1]))
        tokens, lps = out.tokens.tolist(), out.logprobs.tolist()
        tops = list(zip(out.top_ids.tolist(), out.top_logprobs.tolist())) if out.top_ids is not None else None
        for j, s in enumerate(rows):
            self._record(s, tokens[j], lps[j], tops[j] if tops else None)

    def _allowed(self, rows: list[DecodeSequence], vocab: int) -> torch.Tensor | None:
        if not any(s.constraint for s in rows):
            return None
        every = torch.ones(vocab, dtype=torch.bool)
        return torch.stack([s.constraint.allowed(vocab) if s.constraint else every for s in rows]).to(self.host.device)

    def _record(self, s: DecodeSequence, token: int, logprob: float, top: tuple[list, list] | None) -> None:
        if s.constraint is not None:
            s.constraint.advance(token)
        record_token(s, token, logprob, list(zip(*top)) if top else None, self.host.chat.stop_ids, self.text_of)
        if s.request.stream:
            s.request.emit("token", s)

    def _drop_cancelled(self) -> None:
        for s in self._live():
            if s.request.cancelled and s.finish_reason is None:
                s.finish_reason = "cancelled"
        self._retire()

    def _retire(self) -> None:
        """Finished rows answer and free their slots; the batch is compacted once more slots are
        free than in use."""
        done = [i for i, s in enumerate(self._rows) if s is not None and s.finish_reason is not None]
        if not done:
            return
        self._keep_finished(done)  # before the answers: the next turn may follow at once
        for i in done:
            s = self._rows[i]
            if s.finish_reason == "error":
                s.request.emit("error", EngineError("the model produced non-finite logits for this request "
                                                    "(its adapter's weights are not finite)"))
            else:
                s.request.emit("finished", s)
        for i in done:
            self._rows[i] = None
        self._kv.free(done)
        live = len(self._live())
        if not live:
            self._rows, self._kv = [], None
        elif len(self._rows) - live > live:
            self._compact()

    def _keep_finished(self, rows: list[int]) -> None:
        """A finished row's K/V (its prompt and all it sampled but the last token, which was never
        forwarded) goes to the prefix cache: an agent's next turn re-sends this turn with its reply
        spliced in as the same ids, and then prefills only what came after."""
        kv = self._kv
        if kv is None or self.prefix.max_bytes <= 0:
            return
        for r in rows:
            s = self._rows[r]
            if s.finish_reason not in ("stop", "length"):
                continue
            length = kv.lengths[r]
            ids = (s.request.prompt_ids + s.token_ids)[:length]
            if len(ids) == length and self.prefix.wants(ids):
                start = kv.width - length
                self.prefix.add(s.request.policy.adapter, ids, [k[r, :, start:kv.width].clone() for k in kv.kbufs],
                                [v[r, :, start:kv.width].clone() for v in kv.vbufs],
                                kv.row_states(r))  # and its layers' states after those `length` tokens
