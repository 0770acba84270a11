"""Search spaces: YAML files read into SearchSpace, Config and the safe expression language."""
