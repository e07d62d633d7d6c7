"""The word-timestamp pass of an encoder-decoder model, between steps (``core_messages.AlignmentScores``).

The window's audio is encoded again (its encoder output may have left the encoder cache with the request)
and the model runs one teacher-forced decoder pass over the finished tokens with explicit attention
(``WhisperForConditionalGeneration.alignment_scores``). Only requests that ask for word timestamps cause
one; the step path never computes attention weights.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core_messages import AlignmentScores


def alignment_scores(model, device: torch.device, call: AlignmentScores) -> np.ndarray:
    """The alignment heads' scaled QK^T of ``call``: float32 [heads, len(call.token_ids), call.num_positions].
    ValueError for a model without cross-attention."""
    if not model.capabilities.encoder_decoder:
        raise ValueError(f"{type(model).__name__} has no cross-attention; word timestamps need a Whisper model.")
    if not call.token_ids:
        raise ValueError("word timestamps: no tokens to align.")
    with torch.inference_mode():
        encoder_out = model.embed_multimodal("audio", [call.audio])[0]             # [positions, d_model]
        token_ids = torch.tensor(call.token_ids, dtype=torch.long, device=device)  # [T]
        scores = model.alignment_scores(encoder_out, token_ids, call.num_positions)
    return scores.float().cpu().numpy()
