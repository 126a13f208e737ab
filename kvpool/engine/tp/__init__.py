"""Tensor parallelism of the bundled engine: rank 0's handle on the other ranks
(:mod:`.workers`), a rank's own loop (:mod:`.rank`, ``python -m kvpool.engine.tp.rank``),
what rank 0 tells them (:mod:`.messages`), how their tensors combine (:mod:`.collective`)
and which slice of each checkpoint tensor a rank holds (:mod:`.layers`)."""
