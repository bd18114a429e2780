"""The decode node: pulls prefilled caches over NIXL and decodes; prefills locally when asked to."""
