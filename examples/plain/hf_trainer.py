"""The plain Hugging Face script that ``examples/hf_trainer.py`` runs on daskdist.

    python -m torch.distributed.run --nproc_per_node 2 examples/plain/hf_trainer.py

``make_model`` and ``train`` are the example's, line for line, but for the lines marked
``# daskdist`` there (tests/test_examples_frameworks.py checks it);
``benchmarks/bench_frameworks.py`` times this script under torchrun against the
example's ``train`` on daskdist.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

SEQ, VOCAB = 32, 256


def make_model(layers: int = 2, width: int = 64):
    """A tiny GPT-2 built from its config (nothing downloaded)."""
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=width,
                                      n_layer=layers, n_head=2))


def train(model, batches, output_dir, max_steps, commit_every=1, callbacks=()):
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, learning_rate=1e-3,
                             per_device_train_batch_size=16, save_strategy="no",
                             logging_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=batches, callbacks=list(callbacks))
    out = trainer.train()
    return out.global_step, out.training_loss


def synthetic(rows: int, seed: int = 0) -> list[dict]:
    """``rows`` token sequences that repeat a short random pattern (learnable)."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, VOCAB, (rows, 4), generator=g)
    ids = pattern.repeat(1, SEQ // 4)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(rows)]


if __name__ == "__main__":
    import tempfile

    print(train(make_model(), synthetic(4096), tempfile.mkdtemp(), max_steps=128))
