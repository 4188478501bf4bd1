#!/usr/bin/env python3
"""Quality at equal tokens: fp32 DiLoCo against compressed pseudo-gradients, side by side.

    python benchmarks/convergence.py                        # 3 peers, tiny, 50 rounds x H=20, lr sweeps
    python benchmarks/convergence.py --rounds 10 --name convergence_smoke --configs "sync fp32"
    python benchmarks/convergence.py --jobs 15 --threads 1           # every run of the sweep at once

Three peers (--peers) train the same model in one process, with the project's own parts: the model,
data sampler and inner trainer (inner.py), the outer loop and its Nesterov step (outer.py)
and each peer's compression codec (compression/codec.py) with its error feedback. Only the
network is left out: the group's messages are handed from codec to codec in memory, in
group order, exactly as the swarm delivers them: fp16, int8, fp4, low-rank and top-k through the
compressed butterfly (compression/butterfly.py: 2 (N-1)/N of a message out per member), top-k with
compression.topk_transport=gather and the "all-gather" configurations all-gathered (N-1 messages out). Every configuration sees the same tokens (rounds x H x batch x
seq per peer) and the same data order per peer; each is swept over a few outer learning
rates (outer lr and momentum must be tuned per mode and compression: notes/outer-loop-
variants.md) and reported at its best. With --jobs, the sweep's runs go to that many worker
processes at once (each with --threads torch threads); every run is still one whole
configuration at one setting, so the results are the same as one after another. Writes
benchmarks/results/<name>.json and .png.

The long horizons (issue 40) take hours on 2 cores, so every run is recorded round by round and
checkpointed in a store (runs/quality/<name>/, benchmarks/quality_store.py): the same command run
again reads finished runs back and resumes the others from their last checkpoint, to the same bits.
`--best-from` runs each configuration at the best outer lr and momentum an earlier result found
(`--lr-factors`: a narrow sweep around it). Beside the curves it reports (benchmarks/quality_report.py)
each configuration's gap to `sync fp32` round by round, its time to within --target-gap of sync fp32's
final loss on the netns benchmark's GPU setting, and the frontier of bytes against loss gap
(<name>_frontier.png):

    python benchmarks/convergence.py --peers 4 --rounds 300 --jobs 2 --name quality_tiny_300 \
        --configs "sync fp32" "sync topk x3" "sync lowrank" --best-from benchmarks/results/convergence*.json

With --device cuda the peers' inner steps run on the GPU in bf16 (the ~25M `small` preset in minutes:
`bash benchmarks/gpu_figures.sh quality-small`); everything else stays on the CPU as in a real peer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.netns.gpu import GpuSetting  # noqa: E402
from benchmarks.quality_configs import BUTTERFLY_CHECK, CONFIGS, EXCHANGE  # noqa: E402
from benchmarks.quality_group import GroupAverager  # noqa: E402
from benchmarks.quality_report import frontier_plot, summarize  # noqa: E402
from benchmarks.quality_store import RunKey, RunStore  # noqa: E402


def shape_of(args: argparse.Namespace) -> dict:
    """What every run of one store shares (quality_store.RunStore refuses a store of another). A GPU run names its
    device (its bf16 inner steps round otherwise than the CPU's fp32 ones: never compared with a CPU run); a CPU
    run names none, as every result written before --device."""
    shape = {"preset": args.preset, "peers": args.peers, "rounds": args.rounds, "inner_steps": args.inner_steps,
             "batch_size": args.batch_size, "warmup": args.warmup, "val_batches": args.val_batches}  # fmt: skip
    return shape if args.device == "cpu" else {**shape, "device": args.device}


def stored_shape(payload: dict) -> dict:
    """`shape_of` a written result. Files written before the shape was recorded hold five of its fields; the others
    are taken as this script's defaults."""
    defaults = {"warmup": 50, "val_batches": 8}
    return payload.get("shape") or {**defaults, **{k: payload[k] for k in ("preset", "peers", "rounds", "inner_steps",
                                                                           "batch_size")}}  # fmt: skip


def baseline_from(path: Path, args: argparse.Namespace, baseline: str = "sync fp32") -> dict:
    """`baseline`'s result from an earlier invocation of the same shape (the lab is deterministic: sync fp32 gives
    the same bits on other machines and days), for a run that compares against it without running it again."""
    import json

    payload = json.loads(path.read_text())
    found = payload.get("results", {}).get(baseline)
    if found is None:
        raise SystemExit(f"--baseline-from {path}: it holds no {baseline!r} result; name a result that ran it")
    stored = stored_shape(payload)
    differ = {k: (v, stored.get(k)) for k, v in shape_of(args).items() if stored.get(k) != v}
    if differ:
        what = ", ".join(f"{k} {mine} here, {theirs} there" for k, (mine, theirs) in differ.items())
        raise SystemExit(f"--baseline-from {path}: another shape ({what}); its {baseline} cannot be compared with "
                         "these runs")  # fmt: skip
    return {**found, "from": str(path)}


def outer_shape(settings: dict, args: argparse.Namespace) -> dict:
    """A configuration's outer mode, sync rounds per round and streaming's tau as a share of a sync round
    (quality_report.round_wall_seconds)."""
    from dilocox_p2p.config import load_config

    overrides = {k: v for k, v in settings.items() if k != EXCHANGE}
    cfg = load_config(overrides={"model.preset": args.preset, "model.stages": 1, "inner.steps": args.inner_steps,
                                 "swarm.enabled": False, **overrides})  # fmt: skip
    syncs = cfg.outer.syncs_per_round
    share = cfg.outer.overlap_steps / (cfg.inner.steps // syncs) if cfg.outer.mode == "streaming" else 0.0
    return {"mode": cfg.outer.mode, "fragments": syncs, "overlap_share": share}


def run(label: str, settings: dict, lr: float, momentum: float, args: argparse.Namespace) -> dict:
    """One configuration at one outer lr and momentum. With `args.store`: recorded round by round, checkpointed
    every `args.checkpoint_every` rounds, resumed from its checkpoint, and not run again once finished."""
    import torch

    from dilocox_p2p.compression.codec import StageCodec
    from dilocox_p2p.config import load_config
    from dilocox_p2p.data import BatchSampler, load_corpus, val_batches
    from dilocox_p2p.fragments import fragment_tensors
    from dilocox_p2p.inner import InnerTrainer
    from dilocox_p2p.outer import OuterLoop

    key = RunKey(label, lr, momentum)
    store = RunStore(args.store, shape_of(args)) if args.store else None
    if store is not None and (done := store.finished(key)) is not None:  # before any model is built
        print(f"  {label} lr {lr} momentum {momentum}: finished before, in {store.root}", flush=True)
        return done
    settings = dict(settings)
    butterfly = settings.pop(EXCHANGE, "butterfly") == "butterfly"
    overrides = {
        "model.preset": args.preset, "model.stages": 1, "run.rounds": args.rounds, "inner.steps": args.inner_steps,
        "inner.batch_size": args.batch_size, "inner.microbatches": 1, "inner.warmup_steps": args.warmup,
        "outer.lr": lr, "outer.momentum": momentum, "swarm.enabled": False, "compression.kind": "none",
        "inner.compile": "off", **settings,
    }  # fmt: skip
    cfg = load_config(overrides=overrides)
    shape = cfg.model.shape
    corpus = load_corpus(cfg.data, shape.seq_len)
    val = val_batches(corpus, shape.seq_len, cfg.inner.batch_size, args.val_batches)
    trainers = [InnerTrainer(cfg, stage=0, device=torch.device(args.device)) for _ in range(args.peers)]
    names = [n for n, _ in trainers[0].module.named_parameters()]
    # streaming: P sync rounds of H/P steps per outer round, each syncing one fragment (as worker.py runs them)
    syncs = cfg.outer.syncs_per_round
    steps, n_syncs = cfg.inner.steps // syncs, cfg.run.rounds * syncs
    fragments = fragment_tensors(names, syncs)
    codecs = [
        [StageCodec(cfg.compression, [names[i] for i in f], [t.params[i].shape for i in f], run_id="bench",
                    max_norm_ratio=cfg.swarm.max_norm_ratio, clip_ratio=cfg.swarm.clip_ratio,
                    direction_screen=cfg.swarm.direction_screen) for f in fragments]
        if cfg.compression.kind != "none" else None
        for t in trainers
    ]  # fmt: skip
    group = GroupAverager(codecs, fragments=syncs, butterfly=butterfly, max_norm_ratio=cfg.swarm.max_norm_ratio,
                          clip_ratio=cfg.swarm.clip_ratio, direction_screen=cfg.swarm.direction_screen)  # fmt: skip
    outers = [OuterLoop(t.params, cfg.outer, group.member(i), fragments=fragments) for i, t in enumerate(trainers)]
    samplers = [BatchSampler(corpus.train, shape.seq_len, cfg.inner.batch_size, seed) for seed in range(args.peers)]
    curve: list[float] = []
    first, spent = 0, 0.0
    if store is not None:
        saved = store.resume(key)
        if saved is not None:
            _restore(saved, outers, trainers, codecs, samplers, group)
            first, spent, curve = saved["syncs_done"], saved["seconds"], list(saved["curve"])
            print(f"  {label} lr {lr} momentum {momentum}: resumed at round {len(curve)}", flush=True)
        store.begin(key, {"settings": settings, "butterfly": butterfly})
    started = time.perf_counter() - spent
    for t in range(first, n_syncs):
        for trainer, outer, sampler in zip(trainers, outers, samplers):
            outer.load_into_model()
            for step in range(steps):
                inputs, targets = sampler.next()
                trainer.train_step(t * steps + step, inputs, targets)
                outer.after_inner_step(step + 1)
        threads = [threading.Thread(target=o.end_round, args=(t,)) for o in outers]
        if t + 1 == n_syncs:
            threads = [threading.Thread(target=lambda o=o: (o.end_round(t), o.drain())) for o in outers]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert all(torch.equal(a, b) for o in outers[1:] for a, b in zip(outers[0].theta_g, o.theta_g)), "theta_g split"
        if (t + 1) % syncs:
            continue  # the curve is per outer round (H inner steps): equal tokens at every point in every mode
        with outers[0].theta_g_in_model():  # the shared model, whatever the peers train from
            curve.append(trainers[0].evaluate(val))
        print(f"  {label} lr {lr} momentum {momentum}: round {len(curve) - 1} val {curve[-1]:.4f}", flush=True)
        if store is not None:
            seconds = time.perf_counter() - started
            store.record_round(key, {"round": len(curve) - 1, "val": curve[-1], "bytes_sent": group.bytes_sent[0],
                                     "seconds": round(seconds, 2)})  # fmt: skip
            if len(curve) % args.checkpoint_every == 0 and t + 1 < n_syncs:
                store.checkpoint(key, _snapshot(t + 1, curve, seconds, outers, trainers, codecs, samplers, group))
    params = trainers[0].n_params()
    ring = 2 * (args.peers - 1) / args.peers * 4 * params * cfg.run.rounds
    result = {
        "outer_lr": lr,
        "outer_momentum": cfg.outer.effective_momentum,
        "val_curve": curve,
        "final_val": curve[-1],
        "bytes_sent_per_peer": group.bytes_sent[0],
        "left_out": group.left_out,
        "ratio_vs_fp32_ring": ring / group.bytes_sent[0],
        "seconds": time.perf_counter() - started,
        "codec_metrics": codecs[0][0].metrics() if codecs[0] is not None else {},
    }
    if store is not None:
        store.finish(key, result)
    return result


def _snapshot(syncs_done: int, curve: list[float], seconds: float, outers: list, trainers: list, codecs: list,
              samplers: list, group: GroupAverager) -> dict:  # fmt: skip
    """Everything a run goes on from after `syncs_done` syncs (quality_store.RunStore.checkpoint)."""
    import torch

    peers = [{"outer": o.state_dict(), "inner": t.state_dict(), "sampler": s.state(),
              "codecs": [c.state_dict() for c in cs] if cs is not None else None}
             for o, t, s, cs in zip(outers, trainers, samplers, codecs)]  # fmt: skip
    return {"rounds_done": len(curve), "syncs_done": syncs_done, "curve": list(curve), "seconds": seconds,
            "peers": peers, "bytes_sent": list(group.bytes_sent), "left_out": group.left_out,
            "rng": torch.get_rng_state()}  # fmt: skip


def _restore(saved: dict, outers: list, trainers: list, codecs: list, samplers: list, group: GroupAverager) -> None:
    import torch

    for peer, o, t, s, cs in zip(saved["peers"], outers, trainers, samplers, codecs, strict=True):
        o.load_state_dict(peer["outer"])
        t.load_state_dict(peer["inner"])
        s.load_state(peer["sampler"])
        for c, c_saved in zip(cs or [], peer["codecs"] or [], strict=True):
            c.load_state_dict(c_saved)
    group.bytes_sent, group.left_out = list(saved["bytes_sent"]), saved["left_out"]
    torch.set_rng_state(saved["rng"])


def run_in_worker(label: str, settings: dict, lr: float, momentum: float, args: argparse.Namespace) -> dict:
    """`run` in a worker process: its own torch threads and its own one-process gloo group."""
    import torch

    torch.set_num_threads(args.threads)
    with _pipeline_group():
        return run(label, settings, lr, momentum, args)


class _pipeline_group:
    """A gloo group of one (PipelineStage wants a process group), for the duration of a `with`."""

    def __enter__(self) -> None:
        import torch.distributed as dist

        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def grid(label: str, best_from: list[Path], lr_factors: list[float]) -> list[tuple[float, float]]:
    """The (outer lr, momentum) pairs a configuration runs at: its best in the first of `best_from` (earlier results
    of this benchmark) that measured it, its lr times each of `lr_factors` (a narrow sweep around it); else its
    whole grid in CONFIGS."""
    import json

    for path in best_from:
        best = json.loads(path.read_text()).get("results", {}).get(label, {}).get("best")
        if best is not None:
            return [(round(best["outer_lr"] * f, 4), best["outer_momentum"]) for f in lr_factors]
    return list(CONFIGS[label][1])


def sweep(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every (configuration, outer lr, momentum) run, by configuration, in grid order."""
    jobs = [(label, CONFIGS[label][0], lr, m) for label in args.configs
            for lr, m in grid(label, args.best_from, args.lr_factors)]  # fmt: skip
    if args.jobs <= 1:
        import torch

        torch.set_num_threads(args.threads or os.cpu_count() or 1)
        with _pipeline_group():
            done = [run(label, settings, lr, m, args) for label, settings, lr, m in jobs]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        args.threads = args.threads or 1
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(run_in_worker, label, settings, lr, m, args) for label, settings, lr, m in jobs]
            done = [f.result() for f in futures]
    out: dict[str, list[dict]] = {label: [] for label in args.configs}
    for (label, *_), result in zip(jobs, done):
        out[label].append(result)
    return out


def plot(results: dict, path: Path, peers: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, r in results.items():
        best = r["best"]
        ax.plot(best["val_curve"], label=f"{label} (lr {best['outer_lr']}, m {best['outer_momentum']}, {best['ratio_vs_fp32_ring']:.0f}x)")
    ax.set_xlabel("round")
    ax.set_ylabel("val loss of theta_g")
    ax.set_title(f"{peers} peers, equal tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--peers", type=int, default=3, help="peers of the group (in one process)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c not in BUTTERFLY_CHECK],
                        choices=list(CONFIGS), help="default: all but the butterfly-against-all-gather pairs "
                        "(docs/benchmarks.md, section 6, runs those)")  # fmt: skip
    parser.add_argument("--name", default="convergence")
    parser.add_argument("--jobs", type=int, default=1, help="runs of the sweep at once, each in its own process")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: all cores, or 1 with --jobs)")
    parser.add_argument("--store", type=Path, default=None,
                        help="where each run is recorded as it goes and checkpointed (default: runs/quality/NAME); "
                        "run the same command again to resume: finished runs are read back, the others go on "
                        "from their last checkpoint")  # fmt: skip
    parser.add_argument("--checkpoint-every", type=int, default=10, help="rounds between a run's checkpoints")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNGs go")
    parser.add_argument("--best-from", type=Path, nargs="*", default=[],
                        help="earlier results of this benchmark: each configuration runs at the best outer lr and "
                        "momentum the first of them that measured it found (its whole grid where none did)")
    parser.add_argument("--baseline-from", type=Path, default=None,
                        help="an earlier result of the same shape whose sync fp32 the gaps are taken to, when "
                        "--configs leaves sync fp32 out (the lab gives the same bits again: no need to rerun it)")
    parser.add_argument("--lr-factors", type=float, nargs="+", default=[1.0],
                        help="with --best-from: the lr found times each of these (e.g. 0.7 1 1.4: a narrow sweep)")
    parser.add_argument("--gpu-link", type=float, default=100.0,
                        help="Mbit/s of the GPU setting time to target is reported for (benchmarks/netns/gpu.py: 1b, H100)")
    parser.add_argument("--target-gap", type=float, default=0.02,
                        help="time to target: until the loss is within this share of sync fp32's final loss")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the peers' inner steps run: cuda trains them in bf16 autocast (inner.precision "
                        "auto), uncompiled, on the first GPU; theta_g, the codecs and the outer step stay on the CPU, "
                        "as in a real peer")  # fmt: skip
    args = parser.parse_args()
    from dilocox_p2p.errors import ConfigError
    from dilocox_p2p.peer_layout import resolve_device

    try:
        resolve_device(args.device, rank=0)  # the peer's own check: a GPU this process can see
    except ConfigError as e:
        parser.error(f"{e}; run on a machine with an NVIDIA GPU, or leave --device out (cpu)")
    if args.checkpoint_every < 1:
        parser.error(f"--checkpoint-every must be at least 1 round, not {args.checkpoint_every}")
    for path in args.best_from:
        if not path.is_file():
            parser.error(f"--best-from {path}: no such result file (benchmarks/results/*.json of this benchmark)")
    if args.baseline_from is not None and not args.baseline_from.is_file():
        parser.error(f"--baseline-from {args.baseline_from}: no such result file")
    if args.baseline_from is not None and "sync fp32" in args.configs:
        parser.error("--baseline-from supplies sync fp32 to a run that leaves it out; this one runs it: drop one")
    baseline = baseline_from(args.baseline_from, args) if args.baseline_from else None
    args.store = args.store or REPO / "runs" / "quality" / args.name
    RunStore(args.store, shape_of(args))  # a store of another shape is refused before any run starts

    from dilocox_p2p.config import PRESETS

    results = {}
    started = time.perf_counter()
    for label, runs in sweep(args).items():
        settings = CONFIGS[label][0]
        best = min(runs, key=lambda r: r["final_val"])
        results[label] = {"settings": settings, "runs": runs, "best": best}
        print(f"{label}: best outer lr {best['outer_lr']} momentum {best['outer_momentum']}, final val {best['final_val']:.4f}, "
              f"{best['ratio_vs_fp32_ring']:.1f}x fewer bytes than an fp32 ring", flush=True)
    if baseline is not None:
        results = {"sync fp32": baseline, **results}
    setting = GpuSetting(link_mbit=args.gpu_link, peers=args.peers)
    outer = {label: outer_shape(CONFIGS[label][0], args) for label in results}
    summary = summarize(results, outer, setting=setting, target_gap=args.target_gap)
    png, frontier = args.out / f"{args.name}.png", args.out / f"{args.name}_frontier.png"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, png, args.peers)
    frontier_plot(summary, frontier, title=f"{args.preset}, {args.peers} peers, {args.rounds} rounds x H={args.inner_steps}")
    payload = {
        "peers": args.peers, "preset": args.preset, "rounds": args.rounds, "inner_steps": args.inner_steps,
        "batch_size": args.batch_size, "device": args.device, "shape": shape_of(args),
        "baseline_from": None if baseline is None else str(args.baseline_from),
        "tokens_per_peer": args.rounds * args.inner_steps * args.batch_size * PRESETS[args.preset].seq_len,
        "jobs": args.jobs, "threads_per_run": args.threads, "seconds": time.perf_counter() - started,
        "store": str(args.store), "gpu_setting": setting.describe(), "target_gap": args.target_gap,
        "results": results, "summary": summary, "plot": png.name, "frontier_plot": frontier.name,
    }  # fmt: skip
    path = write_result(args.name, payload, directory=args.out)
    for label, v in summary.items():
        gap = "" if v["vs_sync_fp32"] is None else (
            f"vs sync fp32 {100 * v['vs_sync_fp32']:+.1f}% (mean {100 * v['gap_mean']:+.1f}%, "
            f"last half at most {100 * v['gap_last_half_max']:+.1f}%)  ")  # fmt: skip
        reach = "never" if v["time_to_target_s"] is None else f"{v['time_to_target_s'] / 3600:.1f} h"
        print(f"{label:24s} final val {v['final_val']:.4f}  {v['ratio_vs_fp32_ring']:7.1f}x  {gap}"
              f"to target {reach}  bar {'met' if v['meets_bar'] else 'not met'}")
    print(f"wrote {path}, {png} and {frontier}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
