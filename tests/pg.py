"""PostgreSQL harness (placeholder until the throwaway cluster lands)."""
