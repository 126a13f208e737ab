"""The model of the bundled engine: the Llama family's network (:mod:`.llama`), its
layers, paged attention and Mixture-of-Experts, the native CPU kernels (:mod:`.native`,
``csrc/``) and fused ops, the checkpoint's ``config.json`` (:mod:`.config`) and loader,
tiny random checkpoints (:mod:`.tiny`) and where the real test model lives."""
