"""The model's option choice lists, a leaf with no imports: the run config's schema takes them as they are
(`config/schema.py`, which imports nothing of the models but this), and `models/config.py` validates against them."""

# What a rematerialised layer keeps for its backward pass: its input only, or also its weight matmuls' outputs.
REMAT_POLICIES = ("full", "matmuls")
# The training attention a run asks for (`models/attention.attention_backend`): the platform's kernel where it covers
# the layer (auto), the XLA reference, the platform's Pallas kernel, or cuDNN.
ATTENTION_REQUESTS = ("auto", "xla", "pallas", "cudnn")
# The backends themselves, which `attention` may also name (tests, and exporting for another platform).
ATTENTION_BACKENDS = ("xla", "pallas_gpu", "pallas_tpu", "cudnn", "pallas_interpret", "pallas_tpu_interpret")
# How attention crosses a sequence split over devices: all-gathered keys and values, or blocks passed round a ring.
SEQUENCE_METHODS = ("gather", "ring")
