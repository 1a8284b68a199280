"""Target models: running an mlx-lm target with feature capture (`adapter`), the per-family
knowledge (`families`), exact rollback per cache type (`rollback`) and Gated DeltaNet layers
run so a verify can be undone (`gated_delta`)."""
