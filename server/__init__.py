"""`tandem serve`: OpenAI-compatible and job endpoints over the workers, or an embedded Runtime."""
