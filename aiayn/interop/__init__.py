"""Weight interop: Hugging Face Marian, CTranslate2 export."""
