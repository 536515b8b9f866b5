// outbox dashboard: live refresh of pages whose <main> has data-refresh (milliseconds).
// Everything else works without this script. Skipped while the tab is hidden or while a
// control inside <main> has the keyboard focus, so a refresh never steals it.
(function () {
  "use strict";
  function start() {
    var main = document.getElementById("main");
    if (!main || !main.dataset.refresh) return;
    var every = parseInt(main.dataset.refresh, 10) || 5000;
    function busy() {
      var a = document.activeElement;
      return document.hidden || (a && a !== main && main.contains(a));
    }
    function tick() {
      if (busy()) return;
      // Without the notice of an action (ok/error/sig): it was shown once; a refresh must
      // not repeat it every few seconds.
      var url = new URL(window.location.href);
      ["ok", "error", "sig"].forEach(function (k) { url.searchParams.delete(k); });
      fetch(url.toString(), { headers: { "Accept": "text/html" }, credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (text) {
          var doc = new DOMParser().parseFromString(text, "text/html");
          var fresh = doc.getElementById("main");
          if (fresh && !busy()) {
            main.innerHTML = fresh.innerHTML;
            main.dataset.refreshed = new Date().toISOString();
          }
        })
        .catch(function () { /* keep the last page; the next tick tries again */ });
    }
    setInterval(tick, every);
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
