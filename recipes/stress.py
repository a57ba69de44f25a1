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

Every cell trains ``recipes/vision/classifier.py``'s ``ImageClassifier`` (the model of ``recipes/cifar100.py``)
(``norm``: SGD, momentum 0.9, Nesterov; ``qk``: AdamW; cosine schedule stepped per step) on ``recipes/vision/data.py``'s
``ImageDataModule`` and records the best and final validation top-1, the first optimizer step
whose training loss was non-finite (the cell then stops and counts as chance accuracy from
there on) and the mean ``phasor/all/grad_cv`` and ``phasor/all/starved_frac`` of
``GradientHomogeneityMonitor``; a ``qk`` cell also the largest ``attention/all/logit_max``, the
smallest ``attention/all/entropy_min`` and the largest ``attention/all/collapsed_frac`` of
``AttentionMonitor`` over training.
An ``lm``/``lm-qk`` cell trains ``recipes/lm.py``'s ``ByteLM`` (:mod:`recipes.sweeps.cells.lm`) and records
the final and best validation bits per byte (a diverged cell counts as 8 bits per byte), the first
non-finite loss step, the loss scaler's skipped steps and final scale (fp16), the OutlierMonitor's
worst absmax, denominator shares and x2_over_fp16_frac, grad_cv and starved_frac, and the largest
attention logit; ``results.csv`` has the arm's factors (``norm``, ``precision``) as columns. Every
``results.csv`` row also says the machine it ran on (device, CPU model, torch's vector ISA, threads).
Outputs in ``--out`` (default ``runs/stress_<dataset>``, ``runs/stress_qk_<dataset>``,
``runs/stress_lm_<dataset>``, ``runs/stress_lm_qk_<dataset>``):

- ``cells/<cell>.json``: one file per finished cell, written atomically; the sweep's record (naming its worker).
  A rerun with the same ``--out`` skips these cells, so an interrupted sweep loses only the
  cells in progress.
- ``results.csv`` (one row per cell), ``robustness.csv`` (LR sensitivity and the largest lr
  still reaching 90 % of the best, per arm and batch size), ``results.md`` (setup, the
  verdict on each claim computed from ``results.csv``, and for every inconclusive comparison
  the seeds per arm that would resolve it, the robustness tables, mean ± sd over seeds per
  cell) and ``results.png`` (top-1 against lr per batch size; ``qk``: top-1 and the largest
  attention logit against lr); ``--sweep lm`` also ``mechanism.csv`` and ``mechanism.png``.
  ``python -m recipes.sweeps.rebuild`` rebuilds a report from its CSV files alone.
- ``tb/<cell>/``: each cell's TensorBoard run (``tensorboard --logdir <out>/tb``).
- ``settings.json``: the settings of the sweep; a rerun with different settings is refused.
  ``data.json``: the classes and the training and validation sizes.

Every cell's settings are checked before the first cell runs (the data once, each arm's model once):
a mistake is one ``error:`` line, exit status 2, and writes nothing. ``--quick`` runs one seed, so
every claim of its report is inconclusive by construction; the report says so and gives the command
that would give verdicts. Ctrl-C keeps the finished cells (exit status 130). While it runs, a sweep
locks its ``--out``: a second sweep into it refuses, naming the process that holds it (a lock left by a killed
process is reported as stale and taken over).

Each cell is a task of a ``dask.distributed`` cluster; this process alone writes the records, as they arrive.
By default the cluster is this machine's (``--jobs N`` worker processes; ``--jobs 1`` trains in this process);
several machines (the ``[cluster]`` extra; the repository and ``--out`` on a shared filesystem):

    # workers you started: dask scheduler; dask worker tcp://HOST:8786 --nthreads 1 (from the repository root,
    # --resources GPU=1 per GPU: a worker process per GPU)
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
