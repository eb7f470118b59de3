"""Per-epoch metrics as sums kept on the device: no host synchronisation inside the training loop."""
import torch
import torch.nn.functional as F

# Kaggle scores submissions by log loss, which is unbounded for a confident mistake (-log 0).
# Clipping p(dog) to [EPS, 1 - EPS] caps one mistake at -log(0.005) = 5.3 while costing a correct
# confident prediction only -log(0.995) = 0.005. Validation log loss and submission.csv share it.
EPS = 0.005

# The order of the sums that batch_sums returns and summarize reads.
LOSS, CORRECT, COUNT, LOG_LOSS = range(4)


def batch_sums(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[summed cross-entropy, correct predictions, samples, summed clipped log loss] of one batch.

    targets: the labels (int64, (batch,)), or soft labels ((batch, 2), --mixup-alpha and
    --cutmix-alpha's mixed targets). With soft labels the loss is F.cross_entropy's with them (a
    mixed sample's is lambda x CE(a) + (1 - lambda) x CE(b)), the log loss is weighted the same
    way, and a prediction counts as correct when it is the dominant label, the target's argmax
    (class 0 where lambda is exactly 1/2).
    """
    logits = logits.detach().float()
    soft = targets.is_floating_point()
    loss = F.cross_entropy(logits, targets.float() if soft else targets, reduction="sum")
    labels = targets.argmax(dim=1) if soft else targets
    correct = (logits.argmax(dim=1) == labels).sum()
    p_dog = logits.softmax(dim=1)[:, 1].clamp(EPS, 1 - EPS)
    w_dog = targets[:, 1].float() if soft else (labels == 1).float()
    log_loss = -(w_dog * p_dog.log() + (1 - w_dog) * (1 - p_dog).log()).sum()
    # The count as a device op: torch.tensor(len(labels), device=cuda) would be a blocking copy.
    count = torch.ones_like(p_dog).sum()
    return torch.stack([loss, correct.float(), count, log_loss])


def summarize(sums: torch.Tensor) -> dict:
    """Means over the samples actually seen: loss, accuracy, log loss and the sample count."""
    loss, correct, count, log_loss = sums.double().tolist()
    count_or_1 = max(count, 1)
    return {"loss": loss / count_or_1, "acc": correct / count_or_1,
            "log_loss": log_loss / count_or_1, "samples": int(round(count))}
