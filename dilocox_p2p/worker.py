"""One stage worker: the round loop of DiLoCoX for the layers of one pipeline stage.

A peer runs M of these, one per stage, in lockstep through the pipeline schedule. Each
owns its layers' inner (AdamW) and outer (Nesterov) state and averages its own shard
with the same stage of other peers. The lead stage (0) writes metrics.jsonl and shows
progress; every stage writes its own checkpoints.

    for round t:  theta_local <- theta_g; H pipeline steps; outer step (outer.py);
                  theta_g -> model; validation loss; gather per-stage facts to stage 0;
                  checkpoint every K rounds

In streaming mode a round is a sync round of H/P steps that ends by syncing one fragment
(fragments.py), so the run has rounds x P of them; the records count sync rounds.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import injection, startup
from .checkpoint import latest_common_round, load_checkpoint, save_checkpoint
from .config import Config, config_hash
from .data import BatchSampler, load_corpus, val_batches
from .errors import CheckpointError
from .inner import InnerTrainer
from .control import ControlPlane, StatusBoard
from .fragments import fragment_tensors, of_round
from .logs import set_log_context
from .metrics import MetricsWriter, Progress
from .average import Averager, LocalAverager
from .outer import OuterLoop
from .peer_layout import PeerGroups
from .replicas import ReplicaSync, share_of
from .round_outcome import RoundOutcome
from .round_record import round_record

__all__ = ["StageWorker", "WorkerSpec"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    cfg: Config
    stage: int
    resume: bool
    data_seed: int
    lead_maddrs: tuple[str, ...] = ()
    """Where stage 0's DHT node listens, known before it starts (launch.py); empty: stage 0 tells the others."""
    own_session: bool = False
    """Whether the peer's launcher leads its own session (a supervisor's or setsid's child, not a terminal's
    shell): then every process of the session is this peer's (swarm/priority.py, settle)."""


SAME_STOP_S = 2.0  # a second stop signal this soon after the first is the same request (module docstring of launch)


class StopRequested(Exception):
    """SIGINT/SIGTERM arrived; the round in flight is abandoned."""


class StageWorker:
    def __init__(self, spec: WorkerSpec, device: torch.device, groups: PeerGroups | None = None):
        """`groups`: this process's groups (peer_layout.py); None: the default group is the peer's pipeline."""
        self.spec, self.cfg, self.stage, self.device = spec, spec.cfg, spec.stage, device
        groups = groups or PeerGroups(replica=0, replicas=1, pipeline=None, control=None)
        self.control_group = groups.objects  # this peer's stages (replica 0's pipeline), for objects
        self.run_dir = self.cfg.run.path
        self.lead = self.stage == 0
        self.stop_signal: int | None = None
        self._stop_asked = 0.0  # time.monotonic() of the first stop signal
        self.trainer = InnerTrainer(self.cfg, stage=self.stage, device=device, group=groups.pipeline,
                                    replicas=groups.replicas, replica_group=groups.copies)  # fmt: skip
        # replicas: this stage's copies train their shares of each batch; replica 0 (this worker) sends them each round
        self.replicas = ReplicaSync(self.trainer, groups, self.stage) if groups.replicas > 1 else None
        self.share = share_of(self.cfg.inner.batch_size, groups.replicas, 0)
        startup.mark("model")
        # streaming: each outer round of H steps is P sync rounds of H/P steps, each syncing one fragment
        self.syncs = self.cfg.outer.syncs_per_round
        self.rounds, self.steps = self.cfg.run.rounds * self.syncs, self.cfg.inner.steps // self.syncs
        names = [name for name, _ in self.trainer.module.named_parameters()]
        self.fragments = fragment_tensors(names, self.syncs, stage=self.stage)
        self.averager: Averager = self.make_averager()
        self.outer = OuterLoop(self.trainer.params, self.cfg.outer, self.averager, fragments=self.fragments)
        self.sampler: BatchSampler | None = None
        # middle stages read no data, but run the schedule once per validation batch too
        self.val: list = [(None, None)] * self.cfg.data.val_batches
        if self.trainer.is_first or self.trainer.is_last:
            shape = self.cfg.model.shape
            corpus = load_corpus(self.cfg.data, shape.seq_len)
            self.sampler = BatchSampler(corpus.train, shape.seq_len, self.cfg.inner.batch_size, spec.data_seed)
            self.val = val_batches(corpus, shape.seq_len, self.cfg.inner.batch_size, self.cfg.data.val_batches)
        if self.replicas is not None:  # the pipeline carries a replica's share: each batch in as many pieces
            self.val = [_piece(batch, self.share.stop, i) for batch in self.val for i in range(groups.replicas)]
        startup.mark("corpus")
        self.tokens = 0
        self.n_params_peer = self._sum_over_stages(self.trainer.n_params())

    # ----- hooks the swarm replaces (swarm/worker.py) --------------------------------------
    def make_averager(self) -> Averager:
        return LocalAverager()

    def on_start(self, start: int) -> int:
        """Before the first round: join others; return the round to start from."""
        return start

    def on_boundary(self, boundary: int, outcome: RoundOutcome) -> tuple[int, bool]:
        """After the outer step, before evaluation: (the boundary to go on from, whether the state
        was replaced). A later boundary means this peer jumped ahead to the swarm's state."""
        return boundary, False

    def after_boundary(self, boundary: int, state_hash: str, outcome: RoundOutcome) -> None:
        """After the boundary's state hash (theta_g and momentum) is known (publish it)."""

    def settle_final(self, boundary: int, state_hash: str) -> bool:
        """After the last boundary is published: take the others' state if most hold another (whether
        this worker's state was replaced). No later hash check would find a split left by the last
        exchanges, and the final state is the model the run hands over."""
        return False

    def on_finish(self, boundary: int) -> None:
        """After the last round, before leaving."""

    def take_fault_counts(self) -> dict[str, int]:
        """Faults counted since the last call (failed lookups, repairs...), for the metrics record."""
        return {}

    def compression_facts(self) -> dict[str, Any]:
        """This stage's compression state for the metrics record (low-rank: ranks and captured energy)."""
        return {}

    def take_wire_bytes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(sent, received) bytes this stage moved through the swarm since the last call, every kind of traffic, and
        (sent, received) of those on connections to relay nodes, from one reading (swarm/wire_meter.py); None without
        a swarm or where they cannot be read."""
        return None

    def deadlines(self) -> dict[str, float] | None:
        """This stage's swarm deadlines now (swarm/deadlines.py: learned from its exchanges); None without a swarm."""
        return None

    def take_state_donors(self) -> dict[str, int]:
        """The bytes each donor (peer id) served of the states this stage took from the swarm since the last call."""
        return {}

    def take_source_bytes(self) -> dict[str, list[int]] | None:
        """[sent, received] bytes of this stage's swarm messages since the last call, by what they are for
        (exchange, matchmaking, dht, pushes, held, state, hello, other, own_stages: swarm/protocol_bytes.py); None
        without a swarm."""
        return None

    def extra_state(self) -> dict[str, Any]:
        """This worker's own state beyond theta_g and the inner optimizer, for its checkpoints."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what `extra_state` saved (a checkpoint's whole dict)."""

    def peer_facts(self) -> dict[str, Any]:
        """Who this peer is, for the control plane: peer_id, peer_key (hex), multiaddrs."""
        return {}

    def group_members(self) -> list[str]:
        """Names of this stage's live group members (this worker included), for the control plane."""
        return []

    def client_member(self) -> str:
        """Why this stage averages as a client member (swarm/client_member.py); "": a full member, or alone."""
        return ""

    def close(self) -> None:
        self.averager.close()

    # ----- signals ------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self.stop_signal is not None:
                if time.monotonic() - self._stop_asked < SAME_STOP_S:
                    return  # the same stop twice: sent to the process group (systemd, kill -TERM -PGID) and forwarded
                raise KeyboardInterrupt  # asked again: leave at once
            self.stop_signal, self._stop_asked = signum, time.monotonic()
            logger.warning("got %s: abandoning the round in flight; send it again to exit at once",
                           signal.Signals(signum).name)
            self.on_stop_signal()

        signal.signal(signal.SIGTERM, handler)  # SIGINT is ignored: the launcher turns Ctrl-C into one SIGTERM

    def on_stop_signal(self) -> None:
        """Called in the signal handler when a stop is asked for: let what this worker waits on give up (the
        swarm abandons its exchanges). Only sets flags or events: the handler may interrupt any code."""

    def _check_stop(self) -> None:
        """Raise StopRequested on every stage of this peer if any of them was asked to stop (a collective: all
        stages call it at the same point, so that none waits for a stage that left)."""
        if any(self._all_gather(self.stop_signal is not None)):
            raise StopRequested

    # ----- collectives on the peer's control group ------------------------------------
    def _size(self) -> int:
        """This peer's stages (the processes of its pipeline, replica 0's where it has replicas)."""
        return dist.get_world_size(self.control_group) if dist.is_initialized() else 1

    def _gather(self, item: Any) -> list[Any] | None:
        if self._size() == 1:
            return [item]
        out: list[Any] | None = [None] * self._size() if self.lead else None
        dist.gather_object(item, out, dst=0, group=self.control_group)
        return out

    def _all_gather(self, item: Any) -> list[Any]:
        """`item` from every stage of this peer, in stage order, on every stage."""
        if self._size() == 1:
            return [item]
        out: list[Any] = [None] * self._size()
        dist.all_gather_object(out, item, group=self.control_group)
        return out

    def _sum_over_stages(self, value: int) -> int:
        return sum(self._all_gather(value))

    # ----- state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "config_hash": config_hash(self.cfg),
            "outer": self.outer.state_dict(),
            "inner": self.trainer.state_dict(),
            "data": self.sampler.state() if self.sampler else None,
            "rng": torch.get_rng_state(),
            "tokens": self.tokens,
            **self.extra_state(),
        }

    def restore(self) -> int:
        """Load the newest checkpoint all stages share; return the round to start from."""
        round = latest_common_round(self.run_dir, self.cfg.model.stages)
        if round is None:
            raise CheckpointError(f"--resume: {self.run_dir} holds no checkpoint of all {self.cfg.model.stages} stages")
        state = load_checkpoint(self.run_dir, self.stage, round)
        if state["config_hash"] != config_hash(self.cfg):
            raise CheckpointError(
                f"--resume: the checkpoint in {self.run_dir} was written with another config; "
                "resume with the same config, or start a new run with another --run-dir"
            )
        self.outer.load_state_dict(state["outer"])
        self.trainer.load_state_dict(state["inner"])
        if self.sampler is not None:
            self.sampler.load_state(state["data"])
        torch.set_rng_state(state["rng"])
        self.tokens = state["tokens"]
        self.load_extra_state(state)
        logger.info("resumed from round %d", round)
        return round

    def save(self, round: int) -> None:
        save_checkpoint(self.run_dir, self.stage, round, self.state_dict())

    # ----- the loop ---------------------------------------------------------------------
    def run(self) -> int | None:
        """Train until the run's last round; return the signal number if stopped early."""
        self.board = self.plane = None
        if self.lead:  # status and metrics from the start, joining included
            self.board = StatusBoard(self.cfg, rounds=self.rounds, steps=self.steps)
            self.board.identify(**self.peer_facts())
            self.plane = ControlPlane.start(self.cfg, self.board, self.run_dir)
        final = "failed"
        try:
            stopped = self._run()
            final = "stopped" if stopped else "finished"
            return stopped
        finally:
            if self.plane is not None:
                self.plane.close(final)

    def _set_state(self, state: str) -> None:
        if self.board is not None:
            self.board.set_state(state)

    def _run(self) -> int | None:
        cfg = self.cfg
        self._set_state("joining")
        metrics = progress = None
        try:
            start = self.restore() if self.spec.resume else 0
            start = self.on_start(start)
            startup.mark("joined")
            self._set_state("training")
            self.outer.load_into_model()
            if self.lead:
                metrics = MetricsWriter(self.run_dir / "metrics.jsonl")
                metrics.truncate_from(start)
            if start == 0:
                self._record_initial_val_loss()
                self.save(0)
            if self.lead:
                progress = Progress(rounds=self.rounds, steps=self.steps, first_round=start, style=cfg.control.progress)
            t = start
            while t < self.rounds:
                set_log_context(round=t)
                record, boundary = self.run_round(t, progress)
                if self.lead and record is not None:
                    metrics.append(record)
                    progress.round_done(record)
                    self.board.round_done(record, members=self._members)
                if boundary != t + 1 and self.lead:
                    logger.warning("round %d dropped: this peer took the swarm's state of round %d", t, boundary)
                every = cfg.run.checkpoint_every * self.syncs
                if boundary % every == 0 or boundary == self.rounds or boundary != t + 1:
                    self.save(boundary)
                t = boundary
            self.on_finish(self.rounds)
        except StopRequested:
            if self.replicas is not None:  # the copies saw the same stop, and wait for the next round
                self.replicas.end_round()
            done = latest_common_round(self.run_dir, cfg.model.stages)
            if self.lead:
                logger.warning("stopped; the last checkpoint is at round %s: continue with --resume", done)
            return self.stop_signal or signal.SIGTERM
        finally:
            if self.replicas is not None:
                self.replicas.send_end()
            if progress is not None:
                progress.close()
            self.close()
        return None

    def _record_initial_val_loss(self) -> None:
        val = self.trainer.evaluate(self.val)
        gathered = self._gather(val)
        if self.lead:
            initial = next(v for v in gathered if v is not None)
            path = self.run_dir / "run.json"
            info = json.loads(path.read_text()) if path.exists() else {}
            info.update(initial_val_loss=initial, params=self.n_params_peer)
            path.write_text(json.dumps(info, indent=2) + "\n")
            logger.info("initial val loss %.4f, %d parameters", initial, self.n_params_peer)

    def _train_inner(self, t: int, progress: Progress | None) -> list[float]:
        steps = self.steps
        losses = []
        merge_after = self.outer.tau if self.cfg.outer.mode == "streaming" else 0  # it changes the weights then
        if self.replicas is not None:
            self.replicas.send_round(t * steps, steps, merge_after, self.sampler)
        for i in range(steps):
            inputs, targets = self.sampler.next() if self.sampler else (None, None)
            if inputs is not None:
                inputs, targets = inputs[self.share], targets[self.share]
            result = self.trainer.train_step(t * steps + i, inputs, targets, stop=self.stop_signal is not None)
            if result.stop:
                raise StopRequested
            if result.loss is not None:
                losses.append(result.loss)
            if injection.armed("kill_peer_mid_round", quiet=True, round=t, step=i + 1, stage=self.stage):
                injection.kill_peer(f"round {t}, after inner step {i + 1}")
            self.outer.after_inner_step(i + 1)
            if self.replicas is not None and i + 1 == merge_after:
                self.replicas.send_weights()
            startup.mark("first_step")
            if progress is not None:
                progress.step(t)
            if self.board is not None:
                self.board.step(t, i + 1)
        if self.replicas is not None:
            self.replicas.end_round()
        return losses

    def run_round(self, t: int, progress: Progress | None) -> tuple[dict[str, Any] | None, int]:
        """Train round t; return (the lead's metrics record, the boundary to continue from)."""
        started, compute_start = time.perf_counter(), time.time()
        losses = self._train_inner(t, progress)
        seconds_compute = time.perf_counter() - started
        compute_window = (compute_start, time.time())
        self.tokens += self.round_tokens
        outcome = self.outer.end_round(t)
        if t + 1 == self.rounds:  # the run ends: apply what is still pending
            outcome = outcome.then(self.outer.drain())
        self._check_stop()  # a stop abandons the exchange this round waited for: nothing of it is kept
        seconds_round = time.perf_counter() - started
        boundary, replaced = self.on_boundary(t + 1, outcome)
        state_hash = self.outer.hash()
        jumped = boundary != t + 1  # this peer took the swarm's state of a later boundary: round t is dropped
        if not jumped:
            self.after_boundary(t + 1, state_hash, outcome)
            if t + 1 == self.rounds and self.settle_final(t + 1, state_hash):
                replaced, state_hash = True, self.outer.hash()
        self.outer.load_into_model()
        with self.outer.theta_g_in_model():  # the shared model's loss, in every mode
            val_loss = self.trainer.evaluate(self.val)
        wire = self.take_wire_bytes()
        facts = {
            "hash": state_hash,
            "fragment_hashes": self.outer.fragment_hashes() if self.syncs > 1 else None,
            "replaced": replaced,
            "train_loss": sum(losses) / len(losses) if losses and not jumped else None,
            "val_loss": val_loss,
            "outcome": outcome,
            "seconds_compute": seconds_compute,
            "seconds_round": seconds_round,
            "compute_window": compute_window,
            "faults": self.take_fault_counts(),
            "wire": wire[0] if wire is not None else None,
            "relayed": wire[1] if wire is not None else None,
            "sources": self.take_source_bytes(),
            "state_donors": self.take_state_donors(),
            "deadlines": self.deadlines(),
            "compression": self.compression_facts(),
            "fp32_bytes": 4 * sum(self.trainer.params[i].numel() for i in of_round(self.fragments, t)),
            "members": self.group_members(),
            "client": self.client_member(),
            "peak_gpu_bytes": self.trainer.peak_memory(),
        }
        gathered = self._gather(facts)
        if not self.lead:
            return None, boundary
        self._members = [s["members"] for s in gathered]
        record = round_record(self, boundary - 1, gathered)
        record["dropped_round"] = t if jumped else None
        return record, boundary

    @property
    def round_tokens(self) -> int:
        return self.steps * self.cfg.inner.batch_size * self.cfg.model.shape.seq_len


def _piece(batch: tuple[Any, Any], rows: int, i: int) -> tuple[Any, Any]:
    """Rows i*rows.. of a validation batch (a middle stage's placeholder stays one)."""
    inputs, targets = batch
    if inputs is None:
        return batch
    return inputs[i * rows : (i + 1) * rows], targets[i * rows : (i + 1) * rows]
