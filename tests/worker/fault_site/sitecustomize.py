"""Fault injection for end-to-end tests: a real fault in a real worker's generation loop.

Python imports ``sitecustomize`` at start-up from the first folder of ``sys.path`` that has
one: a test puts this folder on ``PYTHONPATH`` and names a trigger prompt in
``TIDEGATE_TEST_FAULT_PROMPT``. In a ``tidegate worker`` process, a sequence whose prompt is
exactly that text breaks the model's forward pass, then runs as usual: the next step of
transformers' generation thread raises and its loop dies, with this sequence (and any other)
in flight. (Issue 11's empty prompt kills the loop only when it is alone in a step, so it
cannot be the trigger while other sequences run.) Any other process, or no variable:
nothing happens.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

FAULT = "injected fault in the generation loop"
_TRIGGER = os.environ.get("TIDEGATE_TEST_FAULT_PROMPT")

if _TRIGGER and sys.argv[1:2] == ["worker"]:
    from tidegate.engines import generation

    _generate = generation.TransformersGenerator.generate

    def _broken_forward(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(FAULT)

    def _generate_or_break(
        self: Any, seq_id: str, prompt_ids: Sequence[int], params: Any
    ) -> AsyncIterator[Any]:
        if self.decode(list(prompt_ids)) == _TRIGGER:
            self._model.forward = _broken_forward
        return _generate(self, seq_id, prompt_ids, params)

    generation.TransformersGenerator.generate = _generate_or_break  # type: ignore[method-assign]
