"""Models built on flash_layers attention: a BERT-compatible document encoder.

    from flash_layers import models
    model, params = models.from_pretrained("all-MiniLM-L6-v2", impl="auto", max_len=1024, num_labels=5)
    hidden = model.apply({"params": params}, input_ids, segment_ids=segment_ids, method=model.encode)
    logits = model.apply({"params": params}, input_ids, segment_ids, max_docs=4)  # [batch, 4, 5]
"""

from flash_layers.models import assets, pretrained
from flash_layers.models.bert import (
    DTYPES,
    POOLINGS,
    REMAT_POLICIES,
    Bert,
    document_mask,
    init_params,
    param_axes,
    positions_from_segments,
)
from flash_layers.models.pretrained import (
    POSITION_EXTENSIONS,
    CheckpointError,
    extend_positions,
    from_pretrained,
)

__all__ = ["DTYPES", "POOLINGS", "POSITION_EXTENSIONS", "REMAT_POLICIES", "Bert", "CheckpointError", "assets",
           "document_mask", "extend_positions", "from_pretrained", "init_params", "param_axes",
           "positions_from_segments", "pretrained"]
