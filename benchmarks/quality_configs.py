"""The quality lab's configurations (benchmarks/convergence.py): each a name, its config overrides and the outer lr and
momentum pairs it is swept over. One table, so that every result of the lab names its settings the same way."""

from __future__ import annotations

EXCHANGE = "exchange"
"""A setting of this benchmark, not of the config: "all-gather" decodes every member's whole message, as the swarm
did for every compression before the compressed butterfly (quantizers and low-rank ride it by default, as in the
swarm)."""

TOPK_X3 = {"outer.mode": "sync", "compression.kind": "topk", "compression.topk_transport": "butterfly",
           "compression.topk_reduced_multiple": 3}

# configuration -> (settings, (outer lr, outer momentum) pairs swept). The grids start where
# notes/outer-loop-variants.md found each mode best and reach past where earlier 50-round runs of
# this benchmark found it (fp32 sync: lr 0.7 / momentum 0.7; the one-step delay: lr 0.35 / 0.5;
# top-k, whose error feedback stands in for outer momentum: lr 2.0 delayed, 4.0 sync, where lr 6
# and 8 diverged early and feedback decay 0.9 or 1.0 did no better than 0.95).
CONFIGS: dict[str, tuple[dict, list[tuple[float, float]]]] = {
    "sync fp32": ({"outer.mode": "sync"}, [(0.35, 0.7), (0.7, 0.7), (0.7, 0.9), (1.0, 0.7)]),
    "delayed fp32": ({"outer.mode": "delayed"}, [(0.2, 0.7), (0.35, 0.5), (0.35, 0.3), (0.5, 0.5)]),
    "delayed lowrank": ({"outer.mode": "delayed", "compression.kind": "lowrank"},
                        [(0.1, 0.9), (0.2, 0.7), (0.2, 0.5), (0.35, 0.5)]),
    "delayed topk": ({"outer.mode": "delayed", "compression.kind": "topk"}, [(1.0, 0.0), (2.0, 0.0), (3.0, 0.0), (1.0, 0.5)]),
    "sync topk": ({"outer.mode": "sync", "compression.kind": "topk"}, [(3.0, 0.0), (4.0, 0.0), (5.0, 0.0), (2.0, 0.5)]),
    # the overlap modes (issue 18): where the notes found eager and own best, and Streaming DiLoCo's 0.7 / 0.9
    "eager fp32": ({"outer.mode": "eager"}, [(0.2, 0.9), (0.35, 0.7), (0.5, 0.5)]),
    "own fp32": ({"outer.mode": "own"}, [(0.35, 0.7), (0.5, 0.7), (0.7, 0.5)]),
    "streaming P1 fp32": ({"outer.mode": "streaming", "outer.overlap_steps": 5}, [(0.7, 0.9), (0.7, 0.7), (1.0, 0.7)]),
    "streaming P2 fp32": ({"outer.mode": "streaming", "outer.fragments": 2, "outer.overlap_steps": 5},
                          [(0.7, 0.9), (0.7, 0.7), (1.0, 0.7)]),
    # streaming's merge weight alpha (default 0.5) and overlap tau (5 above), at P=1's best lr / momentum
    "streaming P1 alpha 0.25": ({"outer.mode": "streaming", "outer.overlap_steps": 5, "outer.merge_alpha": 0.25},
                                [(0.7, 0.9)]),
    "streaming P1 alpha 0.75": ({"outer.mode": "streaming", "outer.overlap_steps": 5, "outer.merge_alpha": 0.75},
                                [(0.7, 0.9)]),
    "streaming P1 tau 1": ({"outer.mode": "streaming", "outer.overlap_steps": 1}, [(0.7, 0.9)]),
    # join's default compression (int8) in its default mode, and a longer overlap for it: the average of a sync
    # merged tau of the H inner steps after it began (a slow link needs a wide window; issue 37's defaults)
    "streaming P1 int8": ({"outer.mode": "streaming", "outer.overlap_steps": 5, "compression.kind": "int8"},
                          [(0.7, 0.9)]),
    # the defaults at outer momentum 0.7: streaming fp32 and int8 at 0.7 / 0.9 stay within 0.003% of each other for
    # 47 rounds while both fall 6.5% behind sync fp32 (quality_diag_300): the gap is the mode's, and 0.7 helped every
    # fp32 mode of the first sweep (shared/notes/outer-loop-variants.md)
    "streaming P1 int8 m0.7": ({"outer.mode": "streaming", "outer.overlap_steps": 5, "compression.kind": "int8"},
                               [(0.7, 0.7), (1.0, 0.7)]),
    "streaming P1 int8 tau 10": ({"outer.mode": "streaming", "outer.overlap_steps": 10, "compression.kind": "int8"},
                                 [(0.7, 0.9)]),
    "streaming P1 int8 tau 15": ({"outer.mode": "streaming", "outer.overlap_steps": 15, "compression.kind": "int8"},
                                 [(0.7, 0.9)]),
    "streaming P2 fp4": ({"outer.mode": "streaming", "outer.fragments": 2, "outer.overlap_steps": 5,
                          "compression.kind": "fp4"}, [(0.7, 0.7), (1.0, 0.7)]),
    # the quantizers through the compressed butterfly (as the swarm runs them: a reducer re-encodes each span's
    # mean once and keeps that rounding in its error feedback) against the all-gather they replaced
    # (at sync fp32's best pair: the question is what the butterfly changes, not where each kind is best)
    "sync int8": ({"outer.mode": "sync", "compression.kind": "int8"}, [(0.7, 0.7)]),
    "sync int8 all-gather": ({"outer.mode": "sync", "compression.kind": "int8", EXCHANGE: "all-gather"}, [(0.7, 0.7)]),
    # sync int8 at the pair quality_tiny_300's sync fp32 ran at (1.0 / 0.7): streaming's gap is the mode's (+6.5% at
    # round 300 for join's defaults; momentum 0.7 widened it), so the candidate default within 2% is sync's own
    "sync int8 at 1.0": ({"outer.mode": "sync", "compression.kind": "int8"}, [(1.0, 0.7)]),
    # and fp4 (7.5x fewer bytes against int8's 3.9x) at the same pair: if it too is within 2%, its shorter exchange
    # makes it the faster default on the 100 Mbit/s GPU setting
    "sync fp4 at 1.0": ({"outer.mode": "sync", "compression.kind": "fp4"}, [(1.0, 0.7)]),
    "sync fp4": ({"outer.mode": "sync", "compression.kind": "fp4"}, [(0.7, 0.7)]),
    "sync fp4 all-gather": ({"outer.mode": "sync", "compression.kind": "fp4", EXCHANGE: "all-gather"}, [(0.7, 0.7)]),
    "sync lowrank": ({"outer.mode": "sync", "compression.kind": "lowrank"}, [(0.7, 0.7)]),
    "sync lowrank all-gather": ({"outer.mode": "sync", "compression.kind": "lowrank", EXCHANGE: "all-gather"},
                                [(0.7, 0.7)]),
    # top-k through the butterfly (a reducer keeps the top m k values of each chunk of its span's mean, the rest in
    # its own error feedback) against its all-gather (every member's kept values averaged as sent), each swept.
    # (Until 5f6bf01 "sync topk" above was the butterfly at m = 1: results/convergence_butterfly_topk.json.)
    "sync topk all-gather": ({"outer.mode": "sync", "compression.kind": "topk", "compression.topk_transport": "gather"},
                             [(2.0, 0.0), (3.0, 0.0), (4.0, 0.0), (5.0, 0.0)]),
    "sync topk x1": ({"outer.mode": "sync", "compression.kind": "topk", "compression.topk_transport": "butterfly",
                      "compression.topk_reduced_multiple": 1}, [(3.0, 0.0), (4.0, 0.0), (5.0, 0.0), (2.0, 0.5)]),
    "sync topk x2": ({"outer.mode": "sync", "compression.kind": "topk", "compression.topk_transport": "butterfly",
                      "compression.topk_reduced_multiple": 2}, [(3.0, 0.0), (4.0, 0.0)]),
    "sync topk x3": (TOPK_X3, [(3.0, 0.0), (4.0, 0.0)]),
    # issue 40, item 2: what closes top-k's gap at >= 100x. Outer Nesterov momentum on the decoded average with error
    # feedback that keeps everything (decay 1), or beside SparseLoCo's decay; precision against density of the kept
    # values (4 bits at half the density costs fewer bytes than 2 bits; 4 bits at 1/64 and 2 bits at 1/32 are the
    # two single-lever diagnostics, below 100x)
    "sync topk x3 nesterov": ({**TOPK_X3, "compression.feedback_decay": 1.0}, [(0.7, 0.9), (1.0, 0.7), (1.5, 0.5)]),
    "sync topk x3 decay nesterov": (TOPK_X3, [(1.0, 0.7), (2.0, 0.5)]),
    "sync topk x3 4-bit 1/128": ({**TOPK_X3, "compression.topk_bits": 4, "compression.topk_density": 1 / 128},
                                 [(4.0, 0.0)]),
    "sync topk x3 4-bit": ({**TOPK_X3, "compression.topk_bits": 4}, [(4.0, 0.0)]),
    "sync topk x3 1/32": ({**TOPK_X3, "compression.topk_density": 1 / 32}, [(4.0, 0.0)]),
    # one byte budget (x3 at 1/64's, ~114x at 4 peers) shared otherwise between senders and reducers: denser
    # messages, fewer values kept of each span's mean
    "sync topk x2 1/48": ({**TOPK_X3, "compression.topk_reduced_multiple": 2, "compression.topk_density": 1 / 48},
                          [(4.0, 0.0)]),
    "sync topk x1 1/32": ({**TOPK_X3, "compression.topk_reduced_multiple": 1, "compression.topk_density": 1 / 32},
                          [(4.0, 0.0)]),
    # issue 40, item 2: a Muon inner optimizer (MuLoCo, arXiv 2505.23725, reports 2-bit compression at almost no
    # loss with it): Muon on the blocks' matrices, AdamW on the rest, the same inner lr (Muon's update scaled to
    # AdamW's RMS); each compression at its best outer lr and momentum with AdamW
    "sync fp32 muon": ({"outer.mode": "sync", "inner.optimizer": "muon"}, [(1.0, 0.7)]),
    "sync topk x3 muon": ({**TOPK_X3, "inner.optimizer": "muon"}, [(4.0, 0.0)]),
    # ...and whether AdamW gains as much from a larger inner step (the inner lr was never swept: 1e-3, join's default)
    "sync fp32 inner lr 2e-3": ({"outer.mode": "sync", "inner.lr": 2e-3}, [(1.0, 0.7)]),
    "sync fp32 inner lr 4e-3": ({"outer.mode": "sync", "inner.lr": 4e-3}, [(1.0, 0.7)]),
    # issue 40, item 3: join's defaults (streaming, int8, tau 5 of H=20: "streaming P1 int8" above) on the long horizon,
    # and fp4 in their place, at the same outer lr and momentum (join's for streaming)
    "streaming P1 fp4": ({"outer.mode": "streaming", "outer.overlap_steps": 5, "compression.kind": "fp4"},
                         [(0.7, 0.9)]),
    # bounded influence (issue 38): each contribution clipped to clip_ratio times its group's lower median norm, with
    # honest peers only: what it costs them at sync fp32's and int8's settings
    "sync fp32 clip 1.5": ({"outer.mode": "sync", "swarm.clip_ratio": 1.5}, [(1.0, 0.7)]),
    "sync int8 clip 1.5": ({"outer.mode": "sync", "compression.kind": "int8", "swarm.clip_ratio": 1.5}, [(0.7, 0.7)]),
    # the direction screen (swarm.direction_screen, on by default) off, against the defaults above
    "sync fp32 no direction screen": ({"outer.mode": "sync", "swarm.direction_screen": False}, [(1.0, 0.7)]),
    "sync int8 no direction screen": ({"outer.mode": "sync", "compression.kind": "int8", "swarm.direction_screen": False},
                                      [(0.7, 0.7)]),
    "sync lowrank no direction screen": ({"outer.mode": "sync", "compression.kind": "lowrank",
                                          "swarm.direction_screen": False}, [(0.7, 0.7)]),
}  # fmt: skip
BUTTERFLY_CHECK = {"sync int8", "sync int8 all-gather", "sync fp4", "sync fp4 all-gather", "sync lowrank",
                   "sync lowrank all-gather", "sync topk all-gather", "sync topk x1", "sync topk x2",
                   "sync topk x3"}  # fmt: skip
