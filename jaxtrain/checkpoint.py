"""Orbax checkpoints: the train state plus the Grain iterator state, saved asynchronously.

Restoring with an abstract target that carries the *current* shardings reshards on the fly, so a run
can resume on a different mesh or device count.
"""

from __future__ import annotations

import os

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory, *, keep: int, async_save: bool = True):
        directory = str(directory)
        if "://" not in directory:  # Orbax's tensorstore writer needs absolute local paths
            directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(
            directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()})

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_iterator) -> None:
        """Returns once the arrays are copied off the devices; the write continues in the background."""
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         data=grain.checkpoint.CheckpointSave(data_iterator)),
                          force=True)

    def restore(self, step: int, abstract_state, data_iterator):
        """`abstract_state` holds jax.ShapeDtypeStruct leaves with the target shardings."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(data_iterator)))
        return restored["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract_with_shardings(abstract_tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)
