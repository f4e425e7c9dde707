"""prefixcache."""
