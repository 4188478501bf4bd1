"""The stage group of the quality lab (benchmarks/convergence.py) in memory: what the swarm would deliver to each member.

Each member's all_reduce resolves once every member has sent its pseudo-gradient of the round: the fp32 butterfly's
mean (each part screened and clipped by its reducer, average.bound, summed in group order), or the decoded mean of
the members' compressed messages through the compressed butterfly (compression/butterfly.py) or all-gathered, exactly
as the swarm's code computes them; only the network is left out.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

__all__ = ["FP32_PART", "GroupAverager", "Member"]


FP32_PART = 1 << 17  # values per part of the fp32 butterfly (hivemind's part_size_bytes, 512 KiB of fp32)


class GroupAverager:
    """The stage group in memory: each member's all_reduce resolves once every member has sent its
    pseudo-gradient of the round, with what the swarm would deliver (the exact fp32 mean, or the
    decoded mean of the members' compressed messages, in group order)."""

    def __init__(self, codecs: list, fragments: int = 1, *, butterfly: bool = True, max_norm_ratio: float = 10.0,
                 clip_ratio: float = 0.0, direction_screen: bool = False):  # fmt: skip
        self.codecs = codecs  # per member: one codec per fragment (None: fp32)
        self.fragments = fragments
        self.max_norm_ratio, self.clip_ratio = max_norm_ratio, clip_ratio  # fp32: the reducers' screen and clip
        self.direction_screen = direction_screen  # ... and direction screen (average.against_the_group)
        self.butterfly = butterfly  # through the compressed butterfly as the swarm runs them (False: all-gathered)
        self.lock = threading.Lock()
        self.pending: dict[int, dict[int, tuple[list, Future]]] = {}
        self.bytes_sent = [0] * len(codecs)
        self.left_out = 0  # messages or parts some member or reducer left out (norm screen, malformed): none expected

    def member(self, index: int) -> "Member":
        return Member(self, index)

    def submit(self, index: int, tensors: list, round: int) -> Future:
        from dilocox_p2p.average import Average, AverageKind
        from dilocox_p2p.fragments import fragment_of

        future: Future = Future()
        with self.lock:
            box = self.pending.setdefault(round, {})
            box[index] = (list(tensors), future)
            if len(box) < len(self.codecs):
                return future
            del self.pending[round]
        members = [box[i] for i in range(len(self.codecs))]
        n = len(members)
        codecs = [c[fragment_of(round, self.fragments)] if c is not None else None for c in self.codecs]
        if codecs[0] is None:
            mean = self._fp32_mean([m[0] for m in members])
            results = [mean] * len(members)
            sent = [4 * sum(t.numel() for t in members[0][0]) * 2 * (n - 1) / n] * n  # ring share
        else:
            rounds = [c.begin(round, m[0]) for c, m in zip(codecs, members)]
            results, sent = self._exchange(rounds)
            assert all(all(a.equal(b) for a, b in zip(results[0], r)) for r in results[1:]), "members differ"
        for i, ((_, fut), tensors) in enumerate(zip(members, results)):
            self.bytes_sent[i] += int(sent[i])
            fut.set_result(Average(kind=AverageKind.AVERAGED, tensors=[t.clone() for t in tensors],
                                   group=tuple(map(str, range(len(members))))))  # fmt: skip
        return future


    def _fp32_mean(self, contributions: list[list]) -> list:
        """The fp32 butterfly's mean: each part of FP32_PART values of the flattened tensors screened and clipped by
        its reducer (average.bound, as allreduce.py does), averaged in group order."""
        import torch

        from dilocox_p2p.average import against_the_group, bound, norm, ordered_mean

        flat = [torch.cat([t.reshape(-1) for t in c]) for c in contributions]
        out = torch.empty_like(flat[0])
        for lo in range(0, out.numel(), FP32_PART):
            parts = [f[lo : lo + FP32_PART] for f in flat]
            refused, scales = bound({i: norm(p) for i, p in enumerate(parts)}, self.max_norm_ratio, self.clip_ratio)
            if self.direction_screen:
                refused |= against_the_group({i: (lambda a, b, p=p: p[a:b]) for i, p in enumerate(parts)
                                              if i not in refused}, parts[0].numel())  # fmt: skip
            self.left_out += len(refused)
            kept = [p.mul(scales[i]) if i in scales else p for i, p in enumerate(parts) if i not in refused]
            out[lo : lo + FP32_PART] = ordered_mean(kept, parts[0].shape)
        shapes, mean, at = [t.shape for t in contributions[0]], [], 0
        for shape in shapes:
            mean.append(out[at : at + shape.numel()].reshape(shape))
            at += shape.numel()
        return mean

    def _exchange(self, rounds: list) -> tuple[list, list[float]]:
        """Each member's decoded average and the bytes it sent: through the compressed butterfly (its parts and
        its reduced part, 2 (N-1)/N of a message), or all-gathered (its message N-1 times)."""
        from dilocox_p2p.compression.butterfly import low_rank_average, low_rank_second

        n, kind = len(rounds), rounds[0].codec.cfg.kind
        if self.butterfly and kind == "lowrank":  # the group's ranks: every member's here (one shared history)
            for r in rounds:
                r.use_ranks([rounds[0].codec.ranks[i] for i in rounds[0].codec.factored])
            first, reduced, sent = _butterfly_phase(rounds, [r.message(1) for r in rounds], phase=1)
            self.left_out += sum(len(r.rejected) for r in reduced)
            second, reduced, more = _butterfly_phase(rounds, [low_rank_second(r, a) for r, a in zip(rounds, first)], phase=2)
            self.left_out += sum(len(r.rejected) for r in reduced)
            averages = [low_rank_average(r, a, reduced[i].energies) for i, (r, a) in enumerate(zip(rounds, second))]
            return averages, [a + b for a, b in zip(sent, more)]
        messages = [r.message(1) for r in rounds]
        if self.butterfly and rounds[0].codec.rides_butterfly(n):  # quantizers; top-k as its transport says
            assembled, reduced, sent = _butterfly_phase(rounds, messages, phase=1)
            self.left_out += sum(len(r.rejected) for r in reduced)
            return [a.tensors for a in assembled], sent
        sizes = [len(m) for m in messages]
        if rounds[0].codec.phases == 2:
            messages = [r.message(2, messages) for r in rounds]
            sizes = [a + len(m) for a, m in zip(sizes, messages)]
        decoded = [r.average(messages, own=i) for i, r in enumerate(rounds)]
        self.left_out += len(decoded[0].rejected)
        return [d.tensors for d in decoded], [s * (n - 1) for s in sizes]


def _butterfly_phase(rounds: list, messages: list[bytes], *, phase: int) -> tuple[list, list, list[float]]:
    """One compressed-butterfly step in memory: each member's assembly of the reduced parts, each reducer's Reduced,
    and the bytes each member sent (its parts to the others, its reduced part to them)."""
    from dilocox_p2p.compression.butterfly import assemble, cut_all, part_spans, reduce

    n = len(rounds)
    parts, spans = [cut_all(m, n) for m in messages], part_spans(messages[0], n)
    reduced = [reduce(rounds[k], [p[k] for p in parts], span=spans[k], phase=phase) for k in range(n)]
    blobs = [r.blob for r in reduced]
    assembled = [assemble(r, blobs, spans=spans, own=i, phase=phase) for i, r in enumerate(rounds)]
    sent = [sum(len(p) for j, p in enumerate(parts[i]) if j != i) + len(blobs[i]) * (n - 1) for i in range(n)]
    return assembled, reduced, sent


class Member:
    def __init__(self, group: GroupAverager, index: int):
        self.group, self.index = group, index

    def all_reduce(self, tensors, *, round: int) -> Future:
        return self.group.submit(self.index, tensors, round)

    def close(self) -> None:
        pass
