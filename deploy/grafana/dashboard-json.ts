// The type that a dashboard's JSON model is checked against (tests/test_grafana.py).
//
// `Dashboard` from @grafana/schema is the classic dashboard model (`panels`, `templating`, `schemaVersion`),
// the one Grafana's "Import dashboard" takes. Its string enums (e.g. `FieldColorModeId`, `ThresholdsMode`)
// reject the plain strings a JSON file holds, so `DashboardJson` widens every string enum to its values
// (`${ThresholdsMode}` is "absolute" | "percentage"); everything else, excess-property checks included, is
// exactly `Dashboard`.
import type { Dashboard } from '@grafana/schema';

type Json<T> = T extends string
  ? T | `${T}`
  : T extends ReadonlyArray<infer U>
    ? Array<Json<U>>
    : T extends object
      ? { [K in keyof T]: Json<T[K]> }
      : T;

export type DashboardJson = Json<Dashboard>;
