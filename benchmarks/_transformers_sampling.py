"""transformers' side of the sampling benchmarks: ``generate`` with random sampling.

One call as ``sampling.py``, ``sampling_gguf.py`` and ``engine_gguf.py`` time it: the
left-padded prompt arrays as torch tensors, ``torch.manual_seed(seed)``, no gradient,
``do_sample`` at the temperature with top-k / top-p off unless given, and
``num_return_sequences`` samples per prompt. Returns the output ids (prompt and
completion) as a numpy array.
"""

from __future__ import annotations

import numpy as np


def sample(hf, tokens_BxP, mask_BxP, seed: int, *, num_samples: int, max_new_tokens: int, **kw):
    """``hf.generate`` on the prompts -> int64 [B * num_samples, P + new] ids.

    ``kw`` go to ``generate`` (temperature, top_k, top_p default to 1.0, 0, 1.0; e.g.
    ``min_new_tokens``, ``eos_token_id``, ``pad_token_id``, ``stop_strings``).
    """
    import torch

    torch.manual_seed(seed)
    kw = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw}
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.from_numpy(np.asarray(tokens_BxP).astype(np.int64)),
            attention_mask=torch.from_numpy(np.asarray(mask_BxP).astype(np.int64)),
            do_sample=True,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            **kw,
        )
    return out.numpy()
