"""Train and ship the embedded tiny chat model (see kvserve/tiny/train.py).

    .venv/bin/python scripts/train_tiny.py --minutes 48 --log /tmp/train_tiny.log
    .venv/bin/python scripts/train_tiny.py --steps 400           # exact, reproducible length
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# On a shared, busy CPU, OpenMP threads that spin at barriers waste their slice; sleeping ones don't.
# Must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvserve.tiny.train import SHIPPED_DIR, TrainConfig, train


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=None, help="wall-clock budget for the training steps")
    p.add_argument("--steps", type=int, default=None, help="exact number of steps (overrides --minutes)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=SHIPPED_DIR)
    p.add_argument("--log", type=Path, default=None, help="append JSON-lines progress here")
    a = p.parse_args(argv)
    if a.steps is None and a.minutes is None:
        p.error("give --minutes or --steps")
    cfg = TrainConfig(num_layers=a.layers, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr, seed=a.seed, threads=a.threads,
                      steps=a.steps, minutes=None if a.steps else a.minutes)
    train(cfg, out_dir=a.out, log_path=a.log)


if __name__ == "__main__":
    main()
