"""The pure, jittable programs of a round and the rules they apply: local steps, the sync seam
(`Sync`) and each fragment's sync program, the parameter servers' rules, inner optimizers."""
