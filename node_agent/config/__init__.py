"""Settings: the config file's schema, the validation pass over it, its messages, and loading.

`schema` declares the settings (frozen msgspec Structs and their defaults),
`validation` checks a parsed document against them and relates the values,
`messages` words every refusal, and `loading` merges the defaults, a YAML
file and command line flags. Import from those modules; this one holds
nothing.
"""
