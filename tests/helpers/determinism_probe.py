"""Run under one ATEN_CPU_CAPABILITY; print the SHA-256 of every result peers must agree on, as JSON:
the model init (theta_g at round 0), the outer step, the reducer's mean, decoding and mending, and
the compression codecs (quantization, top-k, the exact low-rank basis and reconstruction, and a
whole stage's codec: its messages and the group's mean, built a slice at a time), and the norms
by which members screen compressed messages (`norms`, with `--threads` to vary torch's threads).

    ATEN_CPU_CAPABILITY=default python -m tests.helpers.determinism_probe --seed 0 --cases 20

Inputs come from numpy (torch's own random kernels are vectorized too, so their bits would
differ by capability before any of our code runs). `fused_control` is an op that is NOT
deterministic across capabilities (add with alpha): it shows the capabilities really differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json

import numpy as np
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from dilocox_p2p.average import fill_missing, fixed_order_sum
from dilocox_p2p.compression.codec import StageCodec
from dilocox_p2p.compression.lowrank import basis, reconstruct
from dilocox_p2p.compression.quantize import dequantize, quantize
from dilocox_p2p.compression.topk import decode_topk, encode_topk
from dilocox_p2p.config import PRESETS, CompressionConfig
from dilocox_p2p.model import build_stage
from dilocox_p2p.outer import OuterNesterov
from dilocox_p2p.average import ordered_mean


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _random_spans(rng: np.random.Generator, total: int) -> tuple[tuple[int, int], ...]:
    cuts = sorted(set(rng.integers(0, total + 1, size=4).tolist()))
    return tuple((a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b)


def probe(seed: int, cases: int) -> dict[str, str]:
    rng = np.random.default_rng(seed)

    def rand(shape, scale=1.0):
        return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))

    names = ["outer_step", "ordered_mean", "decode", "fill_missing", "quantize", "topk", "lowrank", "stage_codec", "fused_control"]
    out: dict[str, list] = {name: [] for name in names}
    model = build_stage(PRESETS["tiny"], 2, 1, seed)  # theta_g(0): the model init
    out["init"] = [_digest([p.detach() for p in model.parameters()])]
    for _ in range(cases):
        shapes = [tuple(int(d) for d in rng.integers(1, 70, size=rng.integers(1, 4))) for _ in range(rng.integers(1, 4))]
        total = sum(int(np.prod(s)) for s in shapes)
        theta = [rand(s) for s in shapes]
        opt = OuterNesterov(theta, lr=float(rng.uniform(0.05, 1.5)), momentum=float(rng.uniform(0.0, 0.95)))
        for _ in range(3):
            opt.step([rand(s, 1e-2) for s in shapes], missing=_random_spans(rng, total))
        out["outer_step"] += [_digest(theta), _digest(opt.buffers)]

        parts = [rand(shapes[0], 1e-2) for _ in range(int(rng.integers(1, 6)))]
        out["ordered_mean"].append(_digest([ordered_mean(parts, parts[0].shape)]))

        wire = [serialize_torch_tensor(t).SerializeToString() for t in theta]
        decoded = [deserialize_torch_tensor(runtime_pb2.Tensor.FromString(b)) for b in wire]
        out["decode"].append(_digest(decoded))

        mine, other = [rand(s) for s in shapes], [rand(s) for s in shapes]
        filled, still = fill_missing(mine, _random_spans(rng, total), other, _random_spans(rng, total))
        out["fill_missing"].append(_digest(filled) + repr(still))

        for bits in (4, 8):
            message = quantize(theta[0], bits=bits, block=int(rng.integers(1, 100)))
            out["quantize"].append(_digest([dequantize(message)]) + message.codes.hex() + message.scales.hex())
        sparse = encode_topk(theta[0], chunk=int(rng.integers(1, 300)), density=float(rng.uniform(0.01, 1)), bits=2)
        out["topk"].append(_digest([decode_topk(sparse, theta[0].shape)]) + sparse.high.hex() + sparse.levels.hex())

        n, m = (int(v) for v in rng.integers(1, 300, size=2))
        r = int(rng.integers(1, 33))
        base = basis(rand((n, r), 1e-3))
        out["lowrank"].append(_digest([base.p_int, torch.from_numpy(base.scales), torch.from_numpy(base.chol), reconstruct(base, rand((m, r), 1e-3))]))

        for kind in ("fp16", "int8", "fp4", "topk"):  # a whole stage's codec: encode, then the group's mean
            cfg = CompressionConfig(kind=kind, topk_chunk=int(rng.integers(1, 300)), block=int(rng.integers(1, 100)))
            codecs = [StageCodec(cfg, [str(i) for i in range(len(shapes))], shapes, run_id="p") for _ in range(3)]
            rounds = [c.begin(0, [rand(s, 1e-2) for s in shapes]) for c in codecs]
            gathered = [r.message(1) for r in rounds]
            out["stage_codec"].append(_digest(rounds[0].average(gathered, own=0).tensors) + hashlib.sha256(b"".join(gathered)).hexdigest())

        a, b = rand((4099,)), rand((4099,))
        out["fused_control"].append(_digest([a.add(b, alpha=0.3)]))
    out["norms"] = _norms(rng)
    result = {name: hashlib.sha256("".join(values).encode()).hexdigest() for name, values in out.items()}
    result["capability"] = torch.backends.cpu.get_cpu_capability()
    return result


def _norms(rng: np.random.Generator) -> list[str]:
    """The norms by which members screen compressed messages, of vectors long enough that torch splits its
    reductions across threads: fixed_order_sum's own, and whole messages' (Received.norm)."""
    out = []
    for n in (300_007, 1_200_000):
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        out.append(repr(fixed_order_sum(x.double().square())))
    for kind in ("fp16", "int8", "topk"):
        codec = StageCodec(CompressionConfig(kind=kind), ["w"], [(1200, 1000)], run_id="p")
        message = codec.begin(0, [torch.from_numpy(rng.standard_normal((1200, 1000)).astype(np.float32))]).message(1)
        out.append(repr(codec.receive(message, round=0, phase=1).norm()))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(probe(args.seed, args.cases)))
