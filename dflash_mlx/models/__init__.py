"""What to load and how: the registry of pairs (`registry`, models.toml), turning what a
user typed into a choice (`resolve`), the one loader with its CPU dtype rule (`loading`) and
the default block size (`block_size`)."""
