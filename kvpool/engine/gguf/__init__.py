"""GGUF files: reading one (:mod:`.read`), the tokenizer it describes (:mod:`.tokenizer`)
and converting it to a Hugging Face checkpoint folder (:mod:`.convert`,
``kvpool make-model --from-gguf``)."""
