"""The two anchors ours is measured against: one trainer process per peer, started by benchmarks.netns.

    python -m benchmarks.netns.baselines ddp --host 0 --peers 4 --ip 10.1.0.1 --leader-ip 10.1.0.1 --run-dir D
    python -m benchmarks.netns.baselines hivemind-fp16 --host 1 --ip 10.1.0.2 ... --initial-peers /ip4/.../p2p/...
    python -m benchmarks.netns.baselines check-fp16     # 2 averagers on loopback: does fp16 averaging give the mean?

Both train what `dilocox-peer join --stages 1` trains, so that tokens and val loss compare with ours:
the project's model and inner AdamW (InnerTrainer's, as they are: the same
micro-batches and gradient scaling), its lr schedule (`lr_at`) and global-norm clipping, the peer's
BatchSampler seeded by its host index (join's `--data-seed`) and the project's val batches. The step is
written out here (InnerTrainer.train_step runs backward and the optimizer step in one call) because DDP
must all-reduce between them. Checked: one peer of `ddp` ends with the val loss, to the last digit, of
`join --no-swarm --mode sync --outer-lr 1 --set outer.momentum=0` (plain training) at equal steps.

- `ddp`: torch.distributed gloo over the peers' links (tcp:// rendezvous at the leader's address).
  Every inner step all-reduces the gradients as one flat fp32 bucket (sum, then / N), then clips and
  steps: DDP without overlapping the all-reduce with backward.
- `hivemind-fp16` (OpenDiLoCo): H local steps from theta_g, then a blocking
  `DecentralizedAverager.step()` of the pseudo-gradient theta_g - theta_local with
  `Float16Compression` in a group of all N peers, then outer Nesterov on theta_g (torch SGD,
  nesterov=True; OpenDiLoCo's lr 0.7 / momentum 0.9 unless told), and theta_g goes into the model.
  Its own hivemind DHT, joined through the leader's multiaddr (written to RUN_DIR/multiaddrs.txt).

Each writes RUN_DIR/metrics.jsonl: one line per round of H inner steps (with --max-steps, one per step,
without val loss), with the fields of `join`'s records the harness reads (bytes_* are None: the harness
reads the interface counters).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dilocox_p2p.config import Config, load_config  # noqa: E402
from dilocox_p2p.data import BatchSampler, load_corpus, val_batches  # noqa: E402
from dilocox_p2p.endpoints import write_atomically  # noqa: E402
from dilocox_p2p.inner import InnerTrainer, lr_at  # noqa: E402
from dilocox_p2p.metrics import MetricsWriter  # noqa: E402

logger = logging.getLogger("benchmarks.netns.baselines")
DDP_PORT = 29511  # a fresh namespace: nothing else listens there


class Trainer:
    """One peer's model, data and inner optimizer, as `join --stages 1` builds them."""

    def __init__(self, cfg: Config, *, host: int, group: dist.ProcessGroup | None):
        torch.set_num_threads(cfg.inner.threads or 1)
        self.cfg = cfg
        self.inner = InnerTrainer(cfg, stage=0, device=torch.device("cpu"), group=group)
        self.params = self.inner.params
        shape = cfg.model.shape
        corpus = load_corpus(cfg.data, shape.seq_len)
        self.sampler = BatchSampler(corpus.train, shape.seq_len, cfg.inner.batch_size, seed=host)
        self.val = val_batches(corpus, shape.seq_len, cfg.inner.batch_size, cfg.data.val_batches)

    def backward(self) -> float:
        """Gradients of one batch through the peer's own inner trainer (the same micro-batches and gradient
        scaling as `join`); the mean micro-batch loss."""
        inputs, targets = self.sampler.next()
        self.inner.optimizer.zero_grad(set_to_none=True)
        losses = self.inner.forward_backward(inputs, targets)
        return torch.stack(losses).mean().item()

    def step(self, step: int) -> None:
        """Clip the global gradient norm, set the scheduled lr, take the AdamW step (as InnerTrainer.train_step)."""
        inner = self.cfg.inner
        lr = lr_at(step, peak=inner.lr, warmup=inner.warmup_steps, total=self.inner.total_steps,
                   min_ratio=inner.min_lr_ratio)  # fmt: skip
        for group in self.inner.optimizer.param_groups:
            group["lr"] = lr
        if inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, inner.grad_clip)
        self.inner.optimizer.step()

    def evaluate(self) -> float:
        return self.inner.evaluate(self.val)

    def digest(self, tensors: list[torch.Tensor] | None = None) -> str:
        h = hashlib.sha256()
        for t in tensors if tensors is not None else self.params:
            h.update(t.detach().contiguous().numpy().tobytes())
        return h.hexdigest()


class Recorder:
    """metrics.jsonl lines in `join`'s format: one per record window of inner steps."""

    def __init__(self, run_dir: Path, trainer: Trainer):
        self.writer = MetricsWriter(run_dir / "metrics.jsonl")
        self.tokens_per_step = trainer.cfg.inner.batch_size * trainer.cfg.model.shape.seq_len
        self.params = sum(p.numel() for p in trainer.params)
        self.index, self.tokens = 0, 0
        self.reset()

    def reset(self) -> None:
        self.started, self.wait, self.losses, self.steps = time.perf_counter(), 0.0, [], 0

    def step_done(self, loss: float, wait: float = 0.0) -> None:
        self.losses.append(loss)
        self.waited(wait)
        self.steps += 1
        self.tokens += self.tokens_per_step

    def waited(self, seconds: float) -> None:
        """Time spent in communication (counted in seconds_comm_wait)."""
        self.wait += seconds

    def write(self, *, val_loss: float | None, digest: str, **extra: object) -> None:
        seconds = time.perf_counter() - self.started
        self.writer.append({
            "round": self.index, "train_loss": sum(self.losses) / len(self.losses), "val_loss": val_loss,
            "tokens": self.tokens, "tokens_per_s": self.steps * self.tokens_per_step / seconds,
            "seconds_compute": seconds - self.wait, "seconds_comm_wait": self.wait, "seconds_round": seconds,
            "bytes_sent": None, "bytes_received": None, "params": self.params, "stage_hashes": [digest],
            "time": time.time(), **extra,
        })  # fmt: skip
        self.index += 1
        self.reset()


def _record_every(args: argparse.Namespace) -> int:
    return 1 if args.max_steps else args.inner_steps


def _steps(args: argparse.Namespace) -> int:
    total = args.rounds * args.inner_steps
    return min(args.max_steps, total) if args.max_steps else total


def run_ddp(args: argparse.Namespace, cfg: Config) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://{args.leader_ip}:{DDP_PORT}", rank=args.host,
                            world_size=args.peers, timeout=timedelta(seconds=args.timeout))  # fmt: skip
    solo = [dist.new_group([r]) for r in range(args.peers)][args.host]  # each rank's own 1-stage pipeline
    trainer = Trainer(cfg, host=args.host, group=solo)
    recorder = Recorder(args.run_dir, trainer)
    flat = torch.zeros(sum(p.numel() for p in trainer.params))
    dist.barrier()
    for step in range(_steps(args)):
        loss = trainer.backward()
        started = time.perf_counter()
        torch.cat([p.grad.reshape(-1) for p in trainer.params], out=flat)
        dist.all_reduce(flat)  # one fp32 bucket, summed
        flat.div_(args.peers)
        offset = 0
        for p in trainer.params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        recorder.step_done(loss, time.perf_counter() - started)
        trainer.step(step)
        if (step + 1) % _record_every(args) == 0:
            at_round_end = (step + 1) % args.inner_steps == 0 and not args.max_steps
            recorder.write(val_loss=trainer.evaluate() if at_round_end else None, digest=trainer.digest())
    dist.destroy_process_group()


def run_hivemind(args: argparse.Namespace, cfg: Config) -> None:
    import hivemind
    from hivemind.compression import Float16Compression

    from dilocox_p2p.swarm.dht import reachable_maddrs

    with _solo_process_group():
        trainer = Trainer(cfg, host=args.host, group=None)
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.ip}/tcp/0"], initial_peers=args.initial_peers or None, start=True)
        if args.host == 0:
            write_atomically(args.run_dir / "multiaddrs.txt", "\n".join(reachable_maddrs(dht)) + "\n")
        averager = hivemind.averaging.DecentralizedAverager(
            [torch.zeros_like(p) for p in trainer.params], dht, prefix="netns_hivemind_fp16", start=True,
            target_group_size=args.peers, min_group_size=args.peers, min_matchmaking_time=args.matchmaking_time,
            request_timeout=3.0, allreduce_timeout=args.timeout, compression=Float16Compression(),
        )  # fmt: skip
        try:
            _dht_barrier(dht, "netns_hivemind_fp16_ready", args.peers, timeout=args.timeout)
            _train_hivemind(args, trainer, averager)
        finally:
            averager.shutdown()
            dht.shutdown()


def _train_hivemind(args: argparse.Namespace, trainer: Trainer, averager) -> None:
    theta_g = [p.detach().clone() for p in trainer.params]
    outer = torch.optim.SGD(theta_g, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    recorder = Recorder(args.run_dir, trainer)
    step = 0
    for _ in range(args.rounds):
        _load(trainer.params, theta_g)  # every round restarts from theta_g (DiLoCo)
        for _ in range(args.inner_steps):
            loss = trainer.backward()
            trainer.step(step)
            step += 1
            recorder.step_done(loss)
        started = time.perf_counter()
        with averager.get_tensors() as buffers:
            for buf, g, p in zip(buffers, theta_g, trainer.params, strict=True):
                torch.sub(g, p.detach(), out=buf)  # the pseudo-gradient
        group = averager.step(timeout=args.timeout, allow_retries=True)
        with averager.get_tensors() as buffers:
            for g, buf in zip(theta_g, buffers, strict=True):
                g.grad = buf.clone()  # the group's average, or (failed: None) this peer's own delta
        outer.step()
        recorder.waited(time.perf_counter() - started)
        _load(trainer.params, theta_g)
        recorder.write(val_loss=trainer.evaluate(), digest=trainer.digest(theta_g),
                       group_size=len(group) if group else 1)  # fmt: skip
        if not group:
            logger.warning("round %d: the averaging step failed; applied this peer's own delta", recorder.index - 1)


def _load(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(v)


def _dht_barrier(dht, key: str, count: int, *, timeout: float) -> None:
    """Wait (at most `timeout`) until `count` peers have stored their id under `key`, so round 0 starts together."""
    from hivemind.utils import get_dht_time

    dht.store(key, subkey=dht.peer_id.to_base58(), value=True, expiration_time=get_dht_time() + 3600)
    deadline, found = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        found = dht.get(key, latest=True)
        if found is not None and len(found.value) >= count:
            return
        time.sleep(0.5)
    raise SystemExit(f"only {0 if found is None else len(found.value)} of {count} peers joined within {timeout:.0f}s")


class _solo_process_group:
    """A gloo group of one for the duration of a `with`: PipelineStage (InnerTrainer) wants a process group."""

    def __enter__(self) -> None:
        store = Path(tempfile.mkdtemp(prefix="netns-solo-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    def __exit__(self, *exc: object) -> None:
        dist.destroy_process_group()


def check_fp16(size: int = 200_000, tolerance: float = 2e-3) -> float:
    """Two hivemind averagers on loopback average with fp16 compression; return the largest error against
    the true mean, relative to the inputs' largest value. Raises SystemExit if it exceeds `tolerance`
    (numpy 2 makes hivemind's codecs leave the tensors un-averaged without an error)."""
    import hivemind
    import numpy
    from hivemind.compression import Float16Compression

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise SystemExit(f"numpy {numpy.__version__}: hivemind's codecs need numpy<2 (pip install 'numpy<2')")
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(size, generator=gen) for _ in range(2)]
    averagers = [
        hivemind.averaging.DecentralizedAverager([x.clone()], dht, prefix="netns_check", start=True, target_group_size=2,
                                                 min_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0,
                                                 compression=Float16Compression())
        for x, dht in zip(inputs, (first, second), strict=True)
    ]  # fmt: skip
    results: list[object] = [None, None]
    threads = [threading.Thread(target=_step_into, args=(a, results, i)) for i, a in enumerate(averagers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    mean = (inputs[0] + inputs[1]) / 2
    errors = []
    for averager in averagers:
        with averager.get_tensors() as (got,):
            errors.append(float((got - mean).abs().max()) / float(mean.abs().max()))
        averager.shutdown()
    first.shutdown()
    second.shutdown()
    if not all(results) or max(errors) > tolerance:
        raise SystemExit(f"hivemind fp16 averaging is broken here: steps {results}, errors vs the mean {errors}")
    return max(errors)


def _step_into(averager, results: list, index: int) -> None:
    results[index] = averager.step(timeout=60)


def _config(args: argparse.Namespace) -> Config:
    """The Config `join --stages 1` builds from the harness's flags (the same model, data, inner optimizer)."""
    return load_config(overrides={
        "model.preset": args.preset, "model.stages": 1, "run.rounds": args.rounds, "run.run_dir": str(args.run_dir),
        "inner.steps": args.inner_steps, "inner.batch_size": args.batch_size, "inner.warmup_steps": args.warmup,
        "inner.threads": 1, "swarm.enabled": False,
    })  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["ddp", "hivemind-fp16", "check-fp16"])
    parser.add_argument("--host", type=int, default=0, help="this peer's index (rank; its data seed)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--ip", default="127.0.0.1", help="this peer's address (its namespace's eth0)")
    parser.add_argument("--leader-ip", default="127.0.0.1", help="peer 0's address (ddp: the tcp:// rendezvous)")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="hivemind-fp16: the leader's multiaddr")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/netns-baseline"))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=20, help="H (ddp: steps per record)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=50, help="inner lr warm-up steps (inner.warmup_steps)")
    parser.add_argument("--max-steps", type=int, default=0, help="ddp: stop after this many inner steps, one record "
                        "each, no val loss (throughput only; the lr schedule still spans rounds x H)")  # fmt: skip
    parser.add_argument("--outer-lr", type=float, default=0.7, help="hivemind-fp16: outer Nesterov lr (OpenDiLoCo 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="hivemind-fp16: outer momentum (OpenDiLoCo 0.9)")
    parser.add_argument("--matchmaking-time", type=float, default=5.0, help="hivemind-fp16: min_matchmaking_time (s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one collective may take")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.kind == "check-fp16":
        print(f"hivemind fp16 averaging: largest error vs the true mean {check_fp16():.2e} of the largest value")
        return 0
    args.run_dir.mkdir(parents=True, exist_ok=True)
    runners: dict[str, Callable[[argparse.Namespace, Config], None]] = {"ddp": run_ddp, "hivemind-fp16": run_hivemind}
    runners[args.kind](args, _config(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
