"""A BERT-base text classifier (Hugging Face transformers, built from its config) on synthetic token sequences.

A script as a user writes it, for ``benchmarks/runners/answer_first_h200.py``: no earlier result was tuned
on it. Each example is drawn from its index: a class-dependent mix of token ids, a random length padded to
128 and a tenth of its tokens masked out in ``__getitem__``, the per-example CPU work of a tokenizing
pipeline. The model takes the batch as keyword arguments and returns its own loss; the script trains at
``batch_size=32`` with AdamW and a linear warm-up and decay, as the transformers examples do.
"""

from __future__ import annotations

import torch
import transformers

CLASSES, LENGTH, VOCAB = 4, 128, 30522


class TokenSequences(torch.utils.data.Dataset):
    def __init__(self, n: int = 16384) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        label = index % CLASSES
        generator = torch.Generator().manual_seed(index)
        length = int(torch.randint(LENGTH // 2, LENGTH + 1, (1,), generator=generator))
        # Each class favours its own quarter of the vocabulary, so the label is learnable from the tokens.
        favoured = torch.randint(label * VOCAB // CLASSES, (label + 1) * VOCAB // CLASSES, (length,),
                                 generator=generator)
        anywhere = torch.randint(1000, VOCAB, (length,), generator=generator)
        tokens = torch.where(torch.rand(length, generator=generator) < 0.3, favoured, anywhere)
        tokens[torch.rand(length, generator=generator) < 0.1] = 103  # [MASK]
        ids = torch.zeros(LENGTH, dtype=torch.long)
        ids[:length] = tokens
        mask = torch.zeros(LENGTH, dtype=torch.long)
        mask[:length] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(label)}


def train(ctx) -> None:
    torch.manual_seed(ctx.seed)
    config = transformers.BertConfig(num_labels=CLASSES)
    model = ctx.model(transformers.BertForSequenceClassification(config))
    optimizer = ctx.optimizer(torch.optim.AdamW, model.parameters(), lr=3e-5 * ctx.lr_scale, weight_decay=0.01)
    loader = ctx.loader(TokenSequences(), batch_size=32)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, ctx.warmup_steps, ctx.optimizer_steps)
    step = ctx.train_step(model, optimizer, clip_grad_norm=1.0, scheduler=schedule)
    for batch in ctx.batches(loader):
        step(batch)
