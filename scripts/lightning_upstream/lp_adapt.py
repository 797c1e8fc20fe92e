"""Helpers for the ADAPTED run only: read checkpoints through the plugin instead of assuming one torch.save file."""
import os


def _lp_load(path, *args, **kwargs):
    from lightning_preempt import ShardedAsyncCheckpointIO

    # a fresh plugin = an independent reader (like torch.load would be)
    return ShardedAsyncCheckpointIO(trust_checkpoints=True).load_checkpoint(str(path))


def _lp_isfile(path):
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, "manifest.json"))


def _lp_load_model(cls, path, **kwargs):
    ckpt = _lp_load(path)
    model = cls(**kwargs)
    model.load_state_dict(ckpt["state_dict"])
    return model
