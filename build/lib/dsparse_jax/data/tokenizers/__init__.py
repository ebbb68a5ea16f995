"""Tokenizers: `base.Tokenizer` (the SentencePiece wrapper, trained in process) and
`gemma.GemmaTokenizer` (a Gemma tokenizer.model with chat tokens and prompt templates)."""
