{{/* Labels of every object: the ones the kustomize manifests carry, and Helm's own. */}}
{{- define "tgp.labels" -}}
app.kubernetes.io/name: tgp
app.kubernetes.io/part-of: tgp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The image of a build: repository and tag (the chart's appVersion when no tag is given). */}}
{{- define "tgp.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The pod's security context: the image's user (Dockerfile), RuntimeDefault seccomp; the
restricted Pod Security Standard. fsGroup: mounted Secret files readable by that group only. */}}
{{- define "tgp.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{- define "tgp.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities: {drop: ["ALL"]}
{{- end }}

{{/* Probes on the metrics port: the process has no other port, and the worker opens it only
once it has connected to Temporal (the startup probe allows two minutes for that). */}}
{{- define "tgp.probes" -}}
startupProbe: {tcpSocket: {port: metrics}, periodSeconds: 5, failureThreshold: 24}
livenessProbe: {tcpSocket: {port: metrics}, periodSeconds: 20, timeoutSeconds: 5, failureThreshold: 3}
readinessProbe: {tcpSocket: {port: metrics}, periodSeconds: 10, timeoutSeconds: 5}
{{- end }}

{{/* Environment both processes (and the codec server) take besides the settings ConfigMap:
the payload keys and the Temporal API key. */}}
{{- define "tgp.sharedEnv" -}}
- {name: TGP_PAYLOAD_KEYS, valueFrom: {secretKeyRef: {name: {{ .Values.payloadKeysSecret }}, key: keys, optional: true}}}
{{- if .Values.temporal.apiKey.secretName }}
- name: TEMPORAL_API_KEY
  valueFrom: {secretKeyRef: {name: {{ .Values.temporal.apiKey.secretName }}, key: {{ .Values.temporal.apiKey.key }}}}
{{- end }}
{{- end }}

{{- define "tgp.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
{{- if .Values.temporal.tls.enabled }}
- {name: temporal-tls, mountPath: /etc/temporal-tls, readOnly: true}
{{- end }}
{{- end }}

{{- define "tgp.volumes" -}}
- {name: tmp, emptyDir: {sizeLimit: 64Mi}}
{{- if .Values.temporal.tls.enabled }}
- name: temporal-tls
  secret: {secretName: {{ .Values.temporal.tls.secretName }}, defaultMode: 0440}
{{- end }}
{{- end }}

{{/* What the pods of a Deployment share: scheduling, pull secrets, a restart when the settings change. */}}
{{- define "tgp.podExtras" -}}
{{- with .pod.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - {name: {{ . }}}
{{- end }}
{{- end }}
{{- end }}
