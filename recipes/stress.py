"""The stress sweeps: arms x learning rates x batch sizes x seeds, with computed verdicts.

Five sweep kinds share the runner (:mod:`recipes.sweeps`: one module per kind, ``norm.py``, ``qk.py``,
``lm.py``, ``lmqk.py``, ``convert.py``): ``--sweep norm`` (the default, the paper's) varies the body norm of a ResNet;
``--sweep qk`` (after Wortsman et al. 2023, arXiv 2309.14322) varies the QK-norm of a small ViT whose
LayerNorms stay; ``--sweep lm`` varies the body norm and the mixed precision of the byte-level Llama of
``recipes/lm.py``; ``--sweep lm-qk`` its QK-norm; ``--sweep convert`` swaps the RMSNorms of that Llama
trained with them (or of ``--pretrained DIR``, your checkpoint) and measures the bpb lost and its healing.
Run from the repository root:

    # offline, on a CPU: scikit-learn's handwritten digits, the defaults for that data
    # (norms layer rms mrs batch; lrs 0.03 0.1 0.3 0.4 1 3; batch sizes 32 64 128; seeds 0 1 2;
    # 10 epochs of a narrow 4-block timm resnet18 on the 8x8 scans; no warm-up; one cell per core)
    python recipes/stress.py --dataset digits
    # a coarse look in a few minutes (one seed, lrs 0.1 0.4 3, batch 32 and 128, 5 epochs)
    python recipes/stress.py --dataset digits --quick
    # the paper's grid on CIFAR-100 (a GPU; ResNet-18 with the CIFAR stem)
    python recipes/stress.py --dataset cifar100 --lrs 0.1 0.3 0.4 --epochs 30
    # the transformer sweep, offline on a CPU (QK-norms none layer rms mrs; lrs 0.001 0.003 0.01
    # 0.03 0.1 0.3; batch size 64; seeds 0 1 2; 20 epochs of a 4-block ViT on 2x2 patches of
    # the 8x8 scans; AdamW; 5 % warm-up); --quick: one seed, lrs 0.003 0.03 0.3, 10 epochs
    python recipes/stress.py --sweep qk --dataset digits
    # on CIFAR-100 (a GPU; ViT-Lite-7/4)
    python recipes/stress.py --sweep qk --dataset cifar100 --epochs 50
    # the language-model sweeps, offline on a CPU, on the standard library's sources (stdlib):
    # arms rms/mrs/layer in fp16 (with a loss scaler) and bf16; in pure fp16 (16-true) rms, mrs and the
    # half-internal rms-half, mrs-half; rms/mrs in fp32 at the smallest, the largest lr and 0.01 (those at
    # 0.01 then go through the mechanism stress: pure fp16, a planted channel); lrs 0.001 0.01 0.1 1;
    # batch 16 windows of 64 bytes; seeds 0-9; 100 AdamW steps of a 2-layer, 32-wide Llama; no warm-up;
    # --quick: one seed, lrs 0.01 1, 40 steps
    python recipes/stress.py --sweep lm --jobs 2
    # QK-norms none layer rms mrs of the same Llama (its RMSNorms stay), bf16; lrs 0.001 0.003 0.01 0.03
    # 0.1 0.3 1; your own text: --dataset text --path FILE_OR_DIR
    python recipes/stress.py --sweep lm-qk --jobs 2
    # what converting a trained model costs: a 2 x 64 Llama trained 600 steps per seed with its RMSNorms (cached
    # in $LIGHTNING_MRS_CACHE/convert_base), swapped per arm (continue, mrs-inherit, mrs-calibrate, the rms
    # control), healed 200 steps (lr 1e-3), the val bpb at step 0 and along the healing; seeds 0 1 2 (the seed sets
    # the base model, the calibration batch and the healing data order); --seq-len N for every LM sweep
    python recipes/stress.py --sweep convert --jobs 1
    # on your own checkpoint (a save_pretrained directory with its tokenizer) and text
    python recipes/stress.py --sweep convert --pretrained DIR --dataset text --path CORPUS --seq-len 256
    # on your own images (DIR/train/<class>/* and DIR/val/<class>/*, or DIR/<class>/*), any recipe model
    python recipes/stress.py --dataset folder --root DIR --epochs 30 --arch resnet50 --image-size 64

What a cell trains and records, the outputs in ``--out`` (``cells/<cell>.json``, ``results.csv``, ``results.md``,
``results.png``, ``tb/``) and how a sweep resumes: docs/recipes.md. Every cell's settings are checked before the first
cell runs: a mistake is one ``error:`` line, exit status 2, and writes nothing. Ctrl-C keeps the finished cells (exit
status 130); a rerun of the same command resumes. ``--quick`` runs one seed, so its report gives no verdicts.

Each cell is a task of a ``dask.distributed`` cluster (this machine's by default: ``--jobs N`` worker processes,
``--jobs 1`` trains in this process); this process alone writes the records. On several machines (the ``[cluster]``
extra; the repository and ``--out`` on a shared filesystem):

    # workers you started (dask scheduler; dask worker tcp://HOST:8786 --nthreads 1 --resources GPU=1, per GPU)
    python recipes/stress.py --dataset cifar100 --scheduler tcp://HOST:8786
    # SLURM jobs started for the sweep (dask-jobqueue): 4 jobs of 4 GPUs, one worker process per GPU
    python recipes/stress.py --dataset cifar100 --slurm --slurm-partition gpu --slurm-gpus 4 --slurm-cpus 32 \
        --slurm-time 04:00:00 --slurm-jobs 4
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script (`python recipes/stress.py`): import the recipes from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from recipes.sweeps.cli import parse_args  # noqa: E402  (after the path: the script's own options)
from recipes.sweeps.runner import main, run  # noqa: E402

__all__ = ["main", "parse_args", "run"]

if __name__ == "__main__":
    sys.exit(run())
