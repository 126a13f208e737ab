"""Engine adapters: what makes an engine's KV cache (and weights) elastic kvpool memory.
The contract every adapter implements (:mod:`.elastic`), the shared ``KVPOOL_*``
settings (:mod:`.env`), the tensor-parallel gang driver (:mod:`.gang`), the
engine-neutral sleep controller (:mod:`.sleep_controller`), and one package per engine
(:mod:`.bundled`, :mod:`.vllm`)."""
