// The console's only script: refresh marked panels, and ask before destructive actions.
// The pages work without it (reload to refresh; actions are plain form posts).
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  for (const panel of document.querySelectorAll("[data-refresh]")) {
    const every = 1000 * Number(panel.dataset.every || 5);
    const refresh = async () => {
      try {
        const response = await fetch(panel.dataset.refresh, { credentials: "same-origin" });
        if (response.redirected) { window.location.reload(); return; }  // logged out
        if (response.ok) panel.innerHTML = await response.text();
      } catch (error) { /* the next refresh tries again */ }
    };
    setInterval(refresh, every);
  }
  for (const button of document.querySelectorAll("[data-confirm]")) {
    button.addEventListener("click", (event) => {
      if (!window.confirm(button.dataset.confirm)) event.preventDefault();
    });
  }
});
