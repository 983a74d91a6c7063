"""Lazy restore: containers start before their memory is read; pages come from the store on demand."""
