"""Models built on flash_layers attention: BERT-family and ModernBERT document encoders.

    from flash_layers import models
    model, params = models.from_pretrained("all-MiniLM-L6-v2", impl="auto", max_len=1024, num_labels=5)
    hidden = model.apply({"params": params}, input_ids, segment_ids=segment_ids, method=model.encode)
    logits = model.apply({"params": params}, input_ids, segment_ids, max_docs=4)  # [batch, 4, 5]

`from_pretrained` reads Hugging Face BERT, RoBERTa, XLM-RoBERTa (-> `Bert`) and ModernBERT
(-> `ModernBert`) checkpoints; both models share one interface (encode, classify, mlm, pool).
"""

from flash_layers.models import assets, pretrained
from flash_layers.models.bert import (
    CHUNK_POOLINGS,
    DTYPES,
    POOLINGS,
    REMAT_POLICIES,
    Bert,
    document_mask,
    init_params,
    param_axes,
    positions_from_segments,
)
from flash_layers.models.hf_fields import CheckpointError
from flash_layers.models.modernbert import ModernBert
from flash_layers.models.pretrained import (
    MODEL_TYPES,
    POSITION_EXTENSIONS,
    extend_positions,
    from_pretrained,
)

__all__ = ["CHUNK_POOLINGS", "DTYPES", "MODEL_TYPES", "POOLINGS", "POSITION_EXTENSIONS", "REMAT_POLICIES",
           "Bert",
           "CheckpointError", "ModernBert", "assets", "document_mask", "extend_positions",
           "from_pretrained", "init_params", "param_axes", "positions_from_segments", "pretrained"]
