{{/*
Names. With the release named "dynsnap" every object has the name deploy/rbac/*.yaml gives it
(dynsnap-controller, dynsnap-agent, dynsnap-user, dynsnap-controller-leader-election); another
release name prefixes them with it, so two releases never share a cluster-scoped object.
*/}}
{{- define "dynsnap.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dynsnap.controller" -}}{{ include "dynsnap.fullname" . }}-controller{{- end -}}
{{- define "dynsnap.agent" -}}{{ include "dynsnap.fullname" . }}-agent{{- end -}}
{{- define "dynsnap.user" -}}{{ include "dynsnap.fullname" . }}-user{{- end -}}
{{- define "dynsnap.uninstall" -}}{{ include "dynsnap.fullname" . }}-uninstall{{- end -}}

{{- define "dynsnap.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component (controller | agent): never change across upgrades. */}}
{{- define "dynsnap.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "dynsnap.image" -}}
{{- $tag := .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- if .root.Values.image.registry -}}
{{ printf "%s/%s:%s" (trimSuffix "/" .root.Values.image.registry) .repository $tag }}
{{- else -}}
{{ printf "%s:%s" .repository $tag }}
{{- end -}}
{{- end -}}

{{/* A setting as an environment variable's value: integers without a float's exponent. */}}
{{- define "dynsnap.int" -}}{{ . | int64 | toString | quote }}{{- end -}}
{{- define "dynsnap.num" -}}{{ . | toString | quote }}{{- end -}}

{{/* The controller's non-root, read-only container (also the uninstall hook's). */}}
{{- define "dynsnap.restrictedPod" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}
{{- define "dynsnap.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}
