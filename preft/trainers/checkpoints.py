"""Checkpoint rotation that deletes only the checkpoints this run wrote.

HF Trainer's rotation (``save_total_limit``) deletes the oldest ``checkpoint-*`` directories it
finds in ``output_dir``, whoever wrote them: a user's own checkpoints there are gone without a
word. The PreFT trainers save as HF does, then stamp the new checkpoint with their run id
(:data:`STAMP`) and rotate among the checkpoints that carry that id alone: the newest
``save_total_limit`` of them stay (and the best one, when ``load_best_model_at_end`` keeps it).

The run id is the one the output directory's marker records (:mod:`preft.output_dirs`: a recipe
claims its directory, and a resumed run keeps its id), else one per trainer.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from preft.output_dirs import owner

#: the file in each checkpoint a PreFT trainer wrote: {"run_id": ...}
STAMP = "preft_checkpoint.json"


def run_id_of(checkpoint: str | Path) -> str | None:
    try:
        return json.loads((Path(checkpoint) / STAMP).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


class OwnCheckpointRotation:
    """Trainer mixin (before the HF trainer class in the bases): rotation of own checkpoints only."""

    @property
    def preft_run_id(self) -> str:
        if getattr(self, "_preft_run_id", None) is None:
            found = owner(self.args.output_dir)
            self._preft_run_id = found["run_id"] if found else uuid.uuid4().hex
        return self._preft_run_id

    def _save_checkpoint(self, model, trial):
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # HF's rotation would delete every checkpoint-* it finds
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if not self.args.should_save:
            return
        run_dir = Path(self._get_output_dir(trial=trial))
        checkpoint = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        (checkpoint / STAMP).write_text(json.dumps({"run_id": self.preft_run_id}) + "\n")
        self._rotate_own_checkpoints(run_dir, limit)

    def _rotate_own_checkpoints(self, run_dir: Path, limit: int | None) -> None:
        if limit is None or limit <= 0:
            return
        own = [c for c in sort_checkpoints(str(run_dir)) if run_id_of(c) == self.preft_run_id]
        keep = set(own[-limit:])
        if self.state.best_model_checkpoint:
            keep.add(str(Path(self.state.best_model_checkpoint)))
        for checkpoint in own:
            if checkpoint not in keep:
                shutil.rmtree(checkpoint, ignore_errors=True)
