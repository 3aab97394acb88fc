/**
 * An API key handed to the page in its URL fragment (`/#key=...`), as `rebar desktop` opens it:
 * the fragment never reaches the server or its logs, and the page removes it from the address at
 * once so a reload or a copied address does not carry the key.
 */

/** The key in a fragment such as `#key=abc` (other parameters ignored), or null when none. */
export function keyFromFragment(hash: string): string | null {
  const params = new URLSearchParams(hash.startsWith("#") ? hash.slice(1) : hash);
  const key = params.get("key")?.trim() ?? "";
  return key === "" || /\s/.test(key) ? null : key;
}

/** The fragment's key, removing the fragment from the page's address; null when none was given. */
export function takeHandedKey(location: Location, history: History): string | null {
  const key = keyFromFragment(location.hash);
  if (key !== null) {
    history.replaceState(history.state, "", location.pathname + location.search);
  }
  return key;
}
