"""Generation with Optimum-exported decoders: the decoding step and its in-place KV cache
(`decoder.DecoderStep`), name discovery (`io_names`), sampling, the `Generator`, chat, saved state."""
