"""A plain function used as a probe by its dotted name (`mylab_extra:top_logit`), never registered here."""

import torch


def top_logit(model, task) -> dict[str, float]:
    """The mean largest logit at the answer positions of the held-out inputs."""
    batch = task.val_batches()[0]
    logits = model(batch.tokens)[batch.loss_mask]
    return {"mylab/top_logit": float(logits.max(-1).values.mean())}
