"""benchmarks.netns: ours against DDP (gloo) and OpenDiLoCo-style hivemind fp16 on shaped links, in one run.

    sudo .venv/bin/python -m benchmarks.netns [--smoke]      (from the repository root; needs root and iproute2)

__main__.py  the one command: calibration, every variant per setting, the all-reduce alone, results
gpu.py       the GPU settings the lab stands for and the lab link rates that match them
variants.py  what runs: ours' modes and compressions at their tuned outer lr, the anchors; peer commands
baselines.py the anchors' per-peer trainer (ddp, hivemind-fp16) on the project's model, data and optimizer
runner.py    one run: N peers in network namespaces (benchmarks/netlab.py), interface counters sampled
allreduce.py the exchange alone through the real SwarmStage, and gloo, against the ideal ring time
report.py    steady-state numbers, targets, plot and markdown
"""
